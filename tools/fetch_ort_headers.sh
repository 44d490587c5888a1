#!/usr/bin/env bash
# fetch_ort_headers.sh DEST_DIR
# fetch_ort_headers.sh --print-mirror   (the Debian archive a fetch would use)
#
# Fetches the ONNX Runtime C/C++ API headers (Debian sid's `libonnxruntime-dev`,
# 1.23.x, ORT_API_VERSION 23) into DEST_DIR without touching the system:
# a private apt sources list, lists and cache under DEST_DIR/apt, then
# `apt-get download` + `dpkg -x`. Nothing is installed and no root-owned apt
# state is read or written (the system's dpkg status is only read by apt).
#
# On success the last line printed on stdout is the include directory
# (DEST_DIR/root/usr/include/onnxruntime), which contains onnxruntime_c_api.h,
# onnxruntime_ep_c_api.h and onnxruntime_cxx_api.h. Progress goes to stderr.
# If that directory already holds the headers, nothing is downloaded.
#
# Environment:
#   ONNX_LIGHT_ORT_DEB_SUITE    Debian suite to fetch from (default: sid)
#   ONNX_LIGHT_ORT_DEB_MIRROR   archive URL (default: the first Debian archive URI the
#                               machine's own apt sources use -- /etc/apt/sources.list,
#                               sources.list.d/*.list and *.sources, a URI ending in /debian --
#                               with the suite replaced; a machine whose apt names no Debian
#                               archive must set this, or ONNXRUNTIME_INCLUDE_DIR)
#   ONNX_LIGHT_APT_ETC          apt configuration folder to read the sources from (default /etc/apt)
#   ONNX_LIGHT_ORT_API_VERSION  expected ORT_API_VERSION (default: 23); a
#                               different value only prints a warning.
#
# Exit status: 0 on success; non-zero with an "fetch_ort_headers: error: ..."
# message on stderr otherwise.
set -euo pipefail

readonly PROG=fetch_ort_headers
readonly PACKAGE=libonnxruntime-dev
readonly SUITE="${ONNX_LIGHT_ORT_DEB_SUITE:-sid}"
# The Debian archive this machine's apt is configured for (so a local mirror or proxy is used).
readonly APT_ETC="${ONNX_LIGHT_APT_ETC:-/etc/apt}"  # (tests point it at fake sources)
apt_debian_uri() {
  local f line uri
  for f in "$APT_ETC/sources.list" "$APT_ETC"/sources.list.d/*.list; do
    [[ -r "$f" ]] || continue
    while read -r line; do
      [[ "$line" =~ ^deb[[:space:]] ]] || continue
      line="${line#deb}"
      line="$(sed -E 's/\[[^]]*\]//' <<<"$line")"
      uri="$(awk '{print $1}' <<<"$line")"
      if [[ "$uri" =~ ^https?://.*/debian/?$ ]]; then printf '%s\n' "${uri%/}"; return 0; fi
    done <"$f"
  done
  for f in "$APT_ETC"/sources.list.d/*.sources; do
    [[ -r "$f" ]] || continue
    while read -r line; do
      [[ "$line" =~ ^URIs:[[:space:]]*(.*)$ ]] || continue
      for uri in ${BASH_REMATCH[1]}; do
        if [[ "$uri" =~ ^https?://.*/debian/?$ ]]; then printf '%s\n' "${uri%/}"; return 0; fi
      done
    done <"$f"
  done
  return 1
}
readonly KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg
readonly EXPECTED_API="${ONNX_LIGHT_ORT_API_VERSION:-23}"
readonly HEADERS=(onnxruntime_c_api.h onnxruntime_ep_c_api.h onnxruntime_cxx_api.h)

log() { printf '%s: %s\n' "$PROG" "$*" >&2; }
die() { printf '%s: error: %s\n' "$PROG" "$*" >&2; exit 1; }

MIRROR="${ONNX_LIGHT_ORT_DEB_MIRROR:-}"
if [[ -z "$MIRROR" ]]; then
  MIRROR="$(apt_debian_uri || true)"
  [[ -n "$MIRROR" ]] || die "no Debian archive (a URI ending in /debian) among the apt sources in $APT_ETC; set ONNX_LIGHT_ORT_DEB_MIRROR to a Debian archive URL, or ONNXRUNTIME_INCLUDE_DIR to a folder with ${HEADERS[*]}"
fi
readonly MIRROR

if [[ $# -eq 1 && "$1" == --print-mirror ]]; then  # the archive a fetch would use, then exit
  printf '%s\n' "$MIRROR"
  exit 0
fi
if [[ $# -ne 1 || -z "$1" || "$1" == -* ]]; then
  printf 'usage: %s DEST_DIR\n' "$0" >&2
  printf 'Fetches the ONNX Runtime headers (Debian %s %s) into DEST_DIR and\n' "$SUITE" "$PACKAGE" >&2
  printf 'prints the include directory on the last line.\n' >&2
  exit 2
fi

mkdir -p -- "$1" || die "cannot create destination directory '$1'"
DEST="$(cd -- "$1" && pwd -P)"
readonly DEST
readonly INCLUDE_DIR="$DEST/root/usr/include/onnxruntime"

have_headers() {
  local h
  for h in "${HEADERS[@]}"; do
    [[ -f "$INCLUDE_DIR/$h" ]] || return 1
  done
}

check_api_version() {
  local v
  v="$(sed -n 's/^#define ORT_API_VERSION \([0-9][0-9]*\).*/\1/p' "$INCLUDE_DIR/onnxruntime_c_api.h" | head -n1)"
  if [[ -z "$v" ]]; then
    log "warning: no '#define ORT_API_VERSION' found in $INCLUDE_DIR/onnxruntime_c_api.h"
  elif [[ "$v" != "$EXPECTED_API" ]]; then
    log "warning: fetched headers have ORT_API_VERSION $v; this project is written against $EXPECTED_API"
    log "warning: (Debian $SUITE moved on?) set ONNXRUNTIME_INCLUDE_DIR to 1.23 headers to be sure"
  fi
}

finish() {
  check_api_version
  printf '%s\n' "$INCLUDE_DIR"
  exit 0
}

# Fast path: already fetched.
if have_headers; then
  finish
fi

for tool in apt-get dpkg; do
  command -v "$tool" >/dev/null 2>&1 ||
    die "'$tool' not found; this script needs a Debian/Ubuntu system. Elsewhere, set ONNXRUNTIME_INCLUDE_DIR to a directory holding ${HEADERS[*]} (ONNX Runtime 1.23)"
done
[[ -r "$KEYRING" ]] ||
  die "Debian archive keyring '$KEYRING' not readable (package debian-archive-keyring); or set ONNXRUNTIME_INCLUDE_DIR"

# Serialize concurrent fetches into the same DEST (e.g. a shared cache dir).
if command -v flock >/dev/null 2>&1; then
  exec 9>"$DEST/.lock"
  flock 9
  if have_headers; then
    finish
  fi
fi

readonly APT_DIR="$DEST/apt"
rm -rf -- "$APT_DIR"
mkdir -p "$APT_DIR/lists/partial" "$APT_DIR/cache/archives/partial" "$APT_DIR/download"
printf 'deb [signed-by=%s] %s %s main\n' "$KEYRING" "$MIRROR" "$SUITE" >"$APT_DIR/sources.list"

APT_OPTS=(
  -o "Dir::Etc::SourceList=$APT_DIR/sources.list"
  -o "Dir::Etc::SourceParts=/dev/null"
  -o "Dir::State::Lists=$APT_DIR/lists"
  -o "Dir::Cache=$APT_DIR/cache"
  -o "Debug::NoLocking=1"
  -o "APT::Update::Post-Invoke-Success::="
  -o "APT::Update::Post-Invoke::="
  -o "APT::Get::List-Cleanup=0"
)

log "apt-get update (private lists in $APT_DIR, $MIRROR suite $SUITE)"
if ! apt-get "${APT_OPTS[@]}" -q update >"$APT_DIR/update.log" 2>&1; then
  cat "$APT_DIR/update.log" >&2
  die "apt-get update for $MIRROR $SUITE failed (network?); log above. Or set ONNXRUNTIME_INCLUDE_DIR"
fi

log "apt-get download $PACKAGE"
if ! (cd "$APT_DIR/download" && apt-get "${APT_OPTS[@]}" -q download "$PACKAGE") >"$APT_DIR/download.log" 2>&1; then
  cat "$APT_DIR/download.log" >&2
  die "apt-get download $PACKAGE from $SUITE failed; log above. Or set ONNXRUNTIME_INCLUDE_DIR"
fi

shopt -s nullglob
debs=("$APT_DIR/download/${PACKAGE}"_*.deb)
shopt -u nullglob
[[ ${#debs[@]} -eq 1 ]] || die "expected one ${PACKAGE}_*.deb in $APT_DIR/download, found ${#debs[@]}"
log "downloaded $(basename -- "${debs[0]}")"

# Extract into a scratch dir, then move into place, so an interrupted run never
# leaves a half-extracted tree that the fast path would accept.
scratch="$(mktemp -d "$DEST/extract.XXXXXX")"
trap 'rm -rf -- "$scratch"' EXIT
dpkg -x "${debs[0]}" "$scratch" || die "dpkg -x ${debs[0]} failed"
for h in "${HEADERS[@]}"; do
  [[ -f "$scratch/usr/include/onnxruntime/$h" ]] ||
    die "${debs[0]} has no usr/include/onnxruntime/$h; the package layout changed. Set ONNXRUNTIME_INCLUDE_DIR"
done
rm -rf -- "$DEST/root"
mv -- "$scratch" "$DEST/root"
trap - EXIT
# Keep the downloaded .deb for reference; drop apt's lists (~100 MB for sid).
rm -rf -- "$APT_DIR/lists" "$APT_DIR/cache"

have_headers || die "headers missing from $INCLUDE_DIR after extraction"
finish
