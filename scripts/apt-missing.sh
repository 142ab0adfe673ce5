# Sourced by setup.sh and setup-fuzz.sh: apt_install_missing TAG PKG...
# installs the Debian packages among PKG that are not installed yet (as
# root, or with sudo); does nothing, quickly, when all are present.
apt_install_missing() {
  local tag="$1"
  shift
  local missing=() p
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  [ ${#missing[@]} -gt 0 ] || return 0
  echo "[$tag] apt-get install ${missing[*]}"
  local sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
}
