#!/usr/bin/env bash
# Fetch the CUDA runtime and CUPTI headers from NVIDIA's PyPI wheels into $1/include, so the
# CUPTI injector builds without a CUDA toolkit. Uses pip (the project's venv when present).
# Exits non-zero on failure; the Makefile then skips the injector and says so.
set -euo pipefail
dest=${1:?usage: fetch_headers.sh DEST}
py=${PY:-python3}
# Versions pinned so every machine compiles against the same struct layouts. The nvcc wheel is
# only there for include/crt/ (host_defines.h and friends, which the runtime headers include).
wheels=(nvidia-cuda-cupti-cu12==12.9.79 nvidia-cuda-runtime-cu12==12.9.79
	nvidia-cuda-nvcc-cu12==12.9.86)
if [ -f "$dest/include/cupti_activity.h" ] && [ -f "$dest/include/crt/host_defines.h" ]; then
	exit 0
fi
tmp=$(mktemp -d "${TMPDIR:-/tmp}/rankwatch-cuda-headers.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
echo "native: fetching CUDA/CUPTI headers (${wheels[*]}) into $dest ..."
"$py" -m pip download --no-deps --progress-bar on -d "$tmp" "${wheels[@]}"
mkdir -p "$tmp/unpacked"
rm -rf "$dest.partial"
for whl in "$tmp"/*.whl; do # headers only; the wheels' libraries and tools are not needed
	"$py" - "$whl" "$tmp/unpacked" <<'PYEOF'
import sys
import zipfile

z = zipfile.ZipFile(sys.argv[1])
z.extractall(sys.argv[2], [n for n in z.namelist() if "/include/" in n])
PYEOF
done
mkdir -p "$dest.partial/include"
cp -r "$tmp"/unpacked/nvidia/cuda_cupti/include/. "$dest.partial/include/"
cp -r "$tmp"/unpacked/nvidia/cuda_runtime/include/. "$dest.partial/include/"
cp -r "$tmp"/unpacked/nvidia/cuda_nvcc/include/crt "$dest.partial/include/"
rm -rf "$dest"
mv "$dest.partial" "$dest"
echo "native: CUDA/CUPTI headers ready in $dest/include"
