#!/usr/bin/env bash
# Runs test binaries on a real verbs stack: soft-RoCE (rdma_rxe) in a QEMU VM booting Debian
# bookworm's own kernel. This host's kernel has no RDMA; the guest's has.
#
#   bash scripts/rdma-vm.sh [--bin NAME=PATH]... [--step LABEL COMMAND]...
#   bash scripts/rdma-vm.sh --build-only
#
# --bin copies a host file into the guest's bin directory as NAME (host and guest are both bookworm,
# glibc 2.36, so host-built test binaries run as they are). --step runs COMMAND (a bash line, run
# as root in that directory, with it on PATH) in the guest; steps run in order, each to its end.
# In the guest before the steps: rxe0 on lo (active MTU 4096) and rxe1 on dummy0 10.0.0.1/24
# (active MTU 1024), the hostname in /etc/hosts.
#
# The image (mmdebstrap bookworm minbase + rdma-core, ~420 MB) is built once into
# target/rdma-vm/image-<hash>/, the hash taken over the package list and the recipe below, so a
# changed recipe builds anew and an unchanged one costs nothing. The guest boots with KVM when KVM
# brings it to init within RDMA_VM_KVM_DEADLINE seconds (on some hosts /dev/kvm is a paravirtual
# hypervisor under which the stock kernel hangs in early boot), with TCG emulation otherwise; the
# log says which. The image is opened read-only (snapshot): runs never change it.
#
# Exit status: the steps' (0 when every step exited 0, 1 otherwise, also when the VM ran past
# RDMA_VM_TIMEOUT); 77 when the VM cannot run here (packages, image, boot), with the reason.
#
# Environment: RDMA_VM_TIMEOUT (the VM's run, seconds, default 2400), RDMA_VM_ACCEL (auto|kvm|tcg,
# default auto), RDMA_VM_SMP (vCPUs, default 2), RDMA_VM_MEM (MiB, default 2048),
# RDMA_VM_KVM_DEADLINE (default 30), RDMA_VM_BOOT_DEADLINE (TCG boot to init, default 300),
# RDMA_VM_BUILD_TIMEOUT (mmdebstrap, default 900).
set -euo pipefail
cd "$(dirname "$0")/.."

TIMEOUT=${RDMA_VM_TIMEOUT:-2400}
ACCEL=${RDMA_VM_ACCEL:-auto}
SMP=${RDMA_VM_SMP:-2}
MEM=${RDMA_VM_MEM:-2048}
KVM_DEADLINE=${RDMA_VM_KVM_DEADLINE:-30}
BOOT_DEADLINE=${RDMA_VM_BOOT_DEADLINE:-300}
BUILD_TIMEOUT=${RDMA_VM_BUILD_TIMEOUT:-900}
for v in TIMEOUT SMP MEM KVM_DEADLINE BOOT_DEADLINE BUILD_TIMEOUT; do
  [[ ${!v} =~ ^[1-9][0-9]*$ ]] || { echo "rdma-vm: RDMA_VM_$v='${!v}' is not a positive integer" >&2; exit 2; }
done
case "$ACCEL" in auto | kvm | tcg) ;; *) echo "rdma-vm: RDMA_VM_ACCEL='$ACCEL' is not auto, kvm or tcg" >&2; exit 2 ;; esac

skip() {
  echo "rdma-vm: skipped: $*" >&2
  exit 77
}
log() { echo "rdma-vm: $*" >&2; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

BINS=()
STEPS=()
BUILD_ONLY=0
while [ $# -gt 0 ]; do
  case "$1" in
    --bin)
      [[ ${2:-} == ?*=?* ]] || { echo "rdma-vm: --bin takes NAME=PATH" >&2; exit 2; }
      [ -f "${2#*=}" ] || { echo "rdma-vm: --bin ${2}: no such file" >&2; exit 2; }
      BINS+=("$2"); shift 2 ;;
    --step)
      [ $# -ge 3 ] || { echo "rdma-vm: --step takes LABEL COMMAND" >&2; exit 2; }
      STEPS+=("$2" "$3"); shift 3 ;;
    --build-only) BUILD_ONLY=1; shift ;;
    *) echo "rdma-vm: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
[ "$BUILD_ONLY" = 1 ] || [ ${#STEPS[@]} -gt 0 ] || { echo "rdma-vm: nothing to run (no --step)" >&2; exit 2; }

# Host packages, installed when missing (without Recommends), as scripts/test.sh does.
HOST_PACKAGES=(qemu-system-x86 mmdebstrap e2fsprogs debian-archive-keyring)
source scripts/lib/apt-missing.sh
install_missing rdma-vm "${HOST_PACKAGES[@]}" >&2 || skip "cannot install ${HOST_PACKAGES[*]} (apt-get failed)"
[ "$(id -u)" -eq 0 ] || skip "building and booting the image needs root (mmdebstrap root mode)"

# The guest's packages and the image recipe: both go into the image's hash.
GUEST_PACKAGES=(linux-image-amd64 kmod iproute2 rdma-core ibverbs-utils ibverbs-providers rdmacm-utils
  perftest libfabric-bin)

# PID 1 of the guest: mounts the share and hands over to the run's own script on it, so that the
# steps and the guest script can change without rebuilding the image. Powers off whatever happens.
guest_init() {
  cat <<'EOF'
#!/bin/bash
mountpoint -q /proc || mount -t proc proc /proc
mountpoint -q /sys || mount -t sysfs sys /sys
mountpoint -q /dev || mount -t devtmpfs dev /dev
mountpoint -q /run || mount -t tmpfs run /run
mount -t tmpfs tmp /tmp
echo "rdma-vm-init: up at $(cut -d' ' -f1 /proc/uptime) s of guest uptime" >/dev/console
mkdir -p /share
if modprobe 9pnet_virtio && mount -t 9p -o trans=virtio,version=9p2000.L,msize=1048576 share /share; then
  bash /share/guest.sh </dev/null >/dev/console 2>&1
else
  echo "rdma-vm-init: cannot mount the 9p share" >/dev/console
fi
sync
umount /share 2>/dev/null
echo o >/proc/sysrq-trigger
sleep 10
EOF
}

# initramfs-tools' configuration, in place before the kernel is installed so the initramfs is
# built trimmed the first time: only what mounting an ext4 root on virtio-blk needs.
initramfs_conf() { printf 'MODULES=list\nRESUME=none\nCOMPRESS=gzip\n'; }
initramfs_hook() {
  cat <<'EOF'
#!/bin/sh
[ "$1" = prereqs ] && exit 0
. /usr/share/initramfs-tools/hook-functions
for m in virtio_pci virtio_blk ext4 crc32c_generic; do force_load "$m"; done
EOF
}

build_image() { # $1: image directory
  local dir=$1 root=$1/rootfs
  mkdir -p "$dir/initramfs-tools/conf.d" "$dir/initramfs-tools/hooks"
  initramfs_conf >"$dir/initramfs-tools/conf.d/rdma-vm.conf"
  initramfs_hook >"$dir/initramfs-tools/hooks/rdma-vm"
  chmod 755 "$dir/initramfs-tools/hooks/rdma-vm"
  local include
  include=$(IFS=,; echo "${GUEST_PACKAGES[*]}")
  # Documentation, manuals and locales are never read in the guest.
  timeout "$BUILD_TIMEOUT" mmdebstrap --variant=minbase --mode=root --include="$include" \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/info/*' \
    --setup-hook="mkdir -p \"\$1/etc\" && cp -a '$dir/initramfs-tools' \"\$1/etc/\"" \
    --customize-hook='rm -rf "$1"/var/cache/apt/* "$1"/var/lib/apt/lists/*' \
    bookworm "$root"
  guest_init >"$root/usr/local/sbin/rdma-vm-init"
  chmod 755 "$root/usr/local/sbin/rdma-vm-init"
  # Drivers a virtio guest never loads: a smaller image, a faster mkfs.
  rm -rf "$root"/lib/modules/*/kernel/drivers/{gpu,media,staging,net/wireless,iio,hid,input,usb,bluetooth} \
    "$root"/lib/modules/*/kernel/sound "$root"/usr/lib/firmware
  cp "$root"/boot/vmlinuz-* "$dir/vmlinuz"
  cp "$root"/boot/initrd.img-* "$dir/initrd.img"
  basename "$root"/boot/vmlinuz-* | sed 's/^vmlinuz-//' >"$dir/kernel-version"
  local mib
  mib=$(($(du -sm "$root" | cut -f1) * 13 / 10 + 64))
  mkfs.ext4 -q -F -L rdma-vm -d "$root" "$dir/rootfs.ext4" "${mib}M"
  rm -rf "$root" "$dir/initramfs-tools"
}

RECIPE_HASH=$( {
  printf '%s\n' "${GUEST_PACKAGES[@]}"
  declare -f guest_init initramfs_conf initramfs_hook build_image
} | sha256sum | cut -c1-12)
VM_DIR=$PWD/target/rdma-vm
IMAGE=$VM_DIR/image-$RECIPE_HASH
mkdir -p "$VM_DIR"
# One run at a time per checkout: the image directory and the share are shared.
exec 9>"$VM_DIR/lock"
flock -n 9 || { log "waiting for another rdma-vm.sh run in this checkout"; flock 9; }
if [ ! -f "$IMAGE/.built" ]; then
  log "building the guest image $IMAGE (bookworm minbase + ${GUEST_PACKAGES[*]})"
  t0=$(now)
  rm -rf "$VM_DIR"/image-*
  mkdir -p "$IMAGE"
  # A subshell outside any condition, so that set -e stops the recipe at its first failure.
  set +e
  (set -e; build_image "$IMAGE") >"$VM_DIR/image-build.log" 2>&1
  rc=$?
  set -e
  for f in vmlinuz initrd.img rootfs.ext4; do [ -s "$IMAGE/$f" ] || rc=1; done
  if [ "$rc" != 0 ]; then
    tail -30 "$VM_DIR/image-build.log" >&2
    rm -rf "$IMAGE"
    skip "the guest image could not be built (mmdebstrap needs the Debian mirror; log above, in full in $VM_DIR/image-build.log)"
  fi
  touch "$IMAGE/.built"
  log "image built in $(since "$t0") s: $(du -sh --apparent-size "$IMAGE/rootfs.ext4" | cut -f1) ext4 ($(du -sh "$IMAGE/rootfs.ext4" | cut -f1) used), kernel $(cat "$IMAGE/kernel-version"), initramfs $(du -h "$IMAGE/initrd.img" | cut -f1)"
else
  log "using the cached image $IMAGE"
fi
[ "$BUILD_ONLY" = 0 ] || exit 0

# The share: the run's guest script, binaries and steps in; logs and statuses out.
SHARE=$VM_DIR/share
rm -rf "$SHARE"
mkdir -p "$SHARE/bin" "$SHARE/steps" "$SHARE/out"
for b in "${BINS[@]}"; do cp "${b#*=}" "$SHARE/bin/${b%%=*}"; done
for ((i = 0; i < ${#STEPS[@]}; i += 2)); do
  n=$(printf '%02d' $((i / 2 + 1)))
  printf '%s\n' "${STEPS[i]}" >"$SHARE/steps/$n.label"
  printf '%s\n' "${STEPS[i + 1]}" >"$SHARE/steps/$n.cmd"
done
cat >"$SHARE/guest.sh" <<'EOF'
# Run by the guest's PID 1 with the share at /share; output goes to the console.
set -u
OUT=/share/out
echo "rdma-vm guest: booted, kernel $(uname -r), $(nproc) vCPU, $(awk '/MemTotal/ {print int($2/1024)}' /proc/meminfo) MiB"
now() { cut -d' ' -f1 /proc/uptime; }
setup() {
  set -e
  hostname rdma-vm
  printf '127.0.0.1 localhost\n10.0.0.1 rdma-vm\n' >/etc/hosts
  ip link set lo up
  modprobe rdma_rxe
  modprobe ib_uverbs
  modprobe rdma_ucm
  rdma link add rxe0 type rxe netdev lo
  modprobe dummy
  ip link set dummy0 up
  ip addr add 10.0.0.1/24 dev dummy0
  rdma link add rxe1 type rxe netdev dummy0
  rdma link show
  for d in rxe0 rxe1; do
    echo "$d: $(ibv_devinfo -d "$d" | awk '/state:|active_mtu:/ {printf "%s %s  ", $1, $2}')"
  done
}
if ! (setup) >"$OUT/setup.log" 2>&1; then
  cat "$OUT/setup.log"
  echo "rdma-vm guest: setting up rxe0/rxe1 failed"
  echo 1 >"$OUT/status"
  exit 0
fi
cat "$OUT/setup.log"
overall=0
for cmd in /share/steps/*.cmd; do
  n=$(basename "$cmd" .cmd)
  label=$(cat "/share/steps/$n.label")
  echo "rdma-vm guest: step $n: $label"
  t0=$(now)
  (cd /share/bin && PATH=/share/bin:$PATH bash -c "$(cat "$cmd")") >"$OUT/$n.log" 2>&1
  rc=$?
  t1=$(now)
  secs=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')
  echo "$rc $secs" >"$OUT/$n.status"
  echo "rdma-vm guest: step $n: exit $rc after $secs s"
  [ "$rc" = 0 ] || overall=1
done
echo "$overall" >"$OUT/status"
sync
EOF

# Boots the guest with accelerator $1 in the background; its console goes to $CONSOLE.
CONSOLE=$VM_DIR/console.log
QEMU_PID=""
boot() {
  local accel_args
  case "$1" in
    kvm) accel_args=(-accel kvm -cpu host) ;;
    tcg) accel_args=(-accel tcg -cpu max) ;;
  esac
  : >"$CONSOLE"
  rm -f "$SHARE/out"/*
  # In a subshell, so that a QEMU killed by a signal is reported in qemu.log, not on our stderr.
  # The subshell passes a TERM on to timeout (which stops QEMU): killing only the subshell would
  # leave a hung KVM guest spinning a core, and holding the lock, until RDMA_VM_TIMEOUT.
  (timeout --kill-after=10 "$TIMEOUT" qemu-system-x86_64 -nodefaults -no-user-config -nic none \
    -machine q35 "${accel_args[@]}" -smp "$SMP" -m "$MEM" -display none -no-reboot \
    -kernel "$IMAGE/vmlinuz" -initrd "$IMAGE/initrd.img" \
    -append "root=/dev/vda rw console=ttyS0 panic=-1 loglevel=4 init=/usr/local/sbin/rdma-vm-init" \
    -drive "file=$IMAGE/rootfs.ext4,format=raw,if=virtio,snapshot=on" \
    -virtfs "local,path=$SHARE,mount_tag=share,security_model=none,id=share" \
    -serial "file:$CONSOLE" &
    q=$!
    trap 'kill "$q" 2>/dev/null' TERM
    wait "$q"
    st=$?
    # A TERM interrupts that wait (status 143) while timeout is still stopping QEMU: wait again.
    if kill -0 "$q" 2>/dev/null; then wait "$q"; st=$?; fi
    exit $st) >"$VM_DIR/qemu.log" 2>&1 &
  QEMU_PID=$!
}
stop() {
  [ -n "$QEMU_PID" ] || return 0
  kill "$QEMU_PID" 2>/dev/null || true
  wait "$QEMU_PID" 2>/dev/null || true
  QEMU_PID=""
}
trap stop EXIT
# Waits up to $1 seconds for the guest's init; 0 when it came up, 1 when the deadline passed or
# QEMU exited first.
wait_for_init() {
  local deadline=$(($(date +%s) + $1))
  while [ "$(date +%s)" -lt "$deadline" ]; do
    grep -q '^rdma-vm-init: up' "$CONSOLE" 2>/dev/null && return 0
    kill -0 "$QEMU_PID" 2>/dev/null || return 1
    sleep 0.5
  done
  return 1
}

T_RUN=$(now)
used=""
if [ "$ACCEL" != tcg ] && [ -w /dev/kvm ]; then
  t0=$(now)
  boot kvm
  if wait_for_init "$KVM_DEADLINE"; then
    used=kvm
    log "booted with KVM in $(since "$t0") s"
  else
    if kill -0 "$QEMU_PID" 2>/dev/null; then
      log "KVM did not bring the guest to init within $KVM_DEADLINE s; falling back to TCG"
    else
      log "QEMU could not run the guest under KVM ($(grep -m1 -i error "$VM_DIR/qemu.log" || tail -1 "$VM_DIR/qemu.log")); falling back to TCG"
    fi
    stop
  fi
elif [ "$ACCEL" != tcg ]; then
  log "no writable /dev/kvm"
fi
if [ -z "$used" ] && [ "$ACCEL" = kvm ]; then
  skip "RDMA_VM_ACCEL=kvm but KVM did not boot the guest"
fi
if [ -z "$used" ]; then
  t0=$(now)
  boot tcg
  if wait_for_init "$BOOT_DEADLINE"; then
    used=tcg
    log "booted with TCG emulation ($SMP vCPU, $MEM MiB) in $(since "$t0") s"
  else
    echo "---- guest console (tail)" >&2
    tail -40 "$CONSOLE" >&2
    echo "---- qemu" >&2
    cat "$VM_DIR/qemu.log" >&2
    stop
    skip "the guest did not boot to init within $BOOT_DEADLINE s under TCG emulation (console above)"
  fi
fi

t0=$(now)
qemu_rc=0
wait "$QEMU_PID" || qemu_rc=$?
QEMU_PID=""
STEPS_SECS=$(since "$t0")

echo "== rdma-vm: guest console ($used)"
sed -n '/^rdma-vm-init: up/,$p' "$CONSOLE" | tr -d '\r'
status=1
if [ "$qemu_rc" = 124 ] || [ "$qemu_rc" = 137 ]; then
  echo "rdma-vm: the VM ran past RDMA_VM_TIMEOUT=$TIMEOUT s and was killed"
elif [ ! -f "$SHARE/out/status" ]; then
  echo "rdma-vm: the guest powered off without writing its status (qemu exit $qemu_rc; console above)"
else
  status=$(cat "$SHARE/out/status")
fi
for cmd in "$SHARE"/steps/*.cmd; do
  n=$(basename "$cmd" .cmd)
  echo "== rdma-vm step $n: $(cat "$SHARE/steps/$n.label")"
  echo "   \$ $(cat "$cmd")"
  [ -f "$SHARE/out/$n.log" ] && cat "$SHARE/out/$n.log"
  if [ -f "$SHARE/out/$n.status" ]; then
    read -r rc secs <"$SHARE/out/$n.status"
    echo "== rdma-vm step $n: exit $rc, $secs s in the guest"
  else
    echo "== rdma-vm step $n: did not finish"
    status=1
  fi
done
echo "== rdma-vm: $([ "$status" = 0 ] && echo passed || echo FAILED) ($used, $SMP vCPU; guest run $STEPS_SECS s after boot, $(since "$T_RUN") s in all)"
[ "$status" = 0 ] || exit 1
