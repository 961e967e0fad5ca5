# Sourced by the scripts that need Debian packages. `install_missing LABEL PACKAGE...` installs the
# packages that are not installed yet (without Recommends; sudo when not root), logging LABEL; it
# returns apt-get's failure for the caller to handle.
install_missing() {
  local label=$1 p missing=() sudo=""
  shift
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  [ ${#missing[@]} -gt 0 ] || return 0
  echo "$label: installing ${missing[*]}" >&2
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq &&
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
}
