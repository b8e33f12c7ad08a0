# Sourced by the scripts: installs the Debian packages the build needs when
# they are missing (fresh machine), and does nothing when they are present.
kvcache_ensure_packages() {
  local missing=()
  for pkg in "$@"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  echo "kvcache: installing missing packages: ${missing[*]}" >&2
  local sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# What every build needs (libzmq: the KV-event publisher example); benchmarks and reports add theirs.
KVCACHE_BUILD_PACKAGES=(cmake make g++ catch2 libfmt-dev pkg-config libzmq3-dev)
