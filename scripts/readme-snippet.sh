#!/usr/bin/env bash
# Builds and runs the README's "Using te-core from another crate" snippet as an outside crate: its
# TOML dependencies (GIT_URL pointing at this checkout's committed HEAD) and its Rust program,
# in a crate of its own under target/readme-snippet. Fails if the snippet does not build or run.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dir="$root/target/readme-snippet"
rm -rf "$dir/src" && mkdir -p "$dir/src"
python3 - "$root/README.md" "$dir" "file://$root" <<'PY'
import re, sys
readme, out, url = sys.argv[1:]
text = open(readme).read()
section = text.split("## Using te-core from another crate", 1)[1].split("\n## ", 1)[0]
toml = re.search(r"```toml\n(.*?)```", section, re.S).group(1)
rust = re.search(r"```rust\n(.*?)```", section, re.S).group(1)
if "GIT_URL" not in toml:
    sys.exit("the README's dependency line no longer names GIT_URL")
manifest = '[package]\nname = "readme-snippet"\nversion = "0.0.0"\nedition = "2021"\npublish = false\n\n[workspace]\n\n'
open(f"{out}/Cargo.toml", "w").write(manifest + toml.replace("GIT_URL", url))
open(f"{out}/src/main.rs", "w").write(rust)
PY
cd "$dir"
# A git dependency reads committed history: a dirty working tree is not what is built.
if [ -n "$(git -C "$root" status --porcelain --untracked-files=no)" ]; then
  echo "readme-snippet: note: uncommitted changes in $root are not part of the build (git dependency)"
fi
rm -f Cargo.lock
cargo run -q
echo "readme-snippet: the README's snippet built against $(git -C "$root" rev-parse --short HEAD) and ran"
