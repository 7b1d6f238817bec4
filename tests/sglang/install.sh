#!/usr/bin/env bash
# Installs real SGLang into its own virtual environment, cached outside the checkout, builds the
# tiny model directory and LoRA adapters the contract suite serves, and compiles the stand-in CUDA
# driver library SGLang needs on a machine without a GPU. Prints the environment's directory.
# Stamps written last mark finished steps; a half-finished step is redone.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
version="${SGLANG_VERSION:-0.5.23}"
peft_version="0.21.2"
root="${INFERBUS_CACHE:-$HOME/.cache/inferbus}/sglang-$version"
stamp="$root/.installed"
want="sglang==$version peft==$peft_version"

if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]]; then
  rm -rf "$root"
  mkdir -p "$(dirname "$root")"
  python3 -m venv "$root"
  # uv installs SGLang's 11 GB (CUDA wheels included) in a minute where pip takes 3.5 on 2 idle
  # cores. Bytecode compiled now: where PYTHONDONTWRITEBYTECODE is set (as on CI's machines), an
  # engine would compile every module it imports again at each start (3 min more for the suite).
  "$root/bin/python" -m pip install --quiet uv >&2
  "$root/bin/uv" pip install --quiet --compile-bytecode --python "$root/bin/python" $want >&2
  echo "$want" > "$stamp"
fi

# Mooncake's transfer engine, CPU build: SGLang's `mooncake_tcp` KV transfer backend for the
# prefill/decode contract tests (test_pd_contract.py). A step of its own, so that adding it does not
# reinstall SGLang. It links the RDMA verbs library even when it only speaks TCP.
mooncake="mooncake-transfer-engine-non-cuda==0.3.13.post1"
if [[ ! -f "$root/.mooncake" || "$(cat "$root/.mooncake")" != "$mooncake" ]]; then
  "$root/bin/uv" pip install --quiet --compile-bytecode --python "$root/bin/python" "$mooncake" >&2
  echo "$mooncake" > "$root/.mooncake"
fi
if ! ldconfig -p | grep -q 'libibverbs\.so\.1 '; then
  if command -v apt-get >/dev/null && [[ "$(id -u)" == 0 ]]; then
    apt-get update -qq >&2 && apt-get install -y -qq libibverbs1 >&2
  else
    echo "install.sh: Mooncake needs libibverbs.so.1 (Debian/Ubuntu: apt-get install libibverbs1)" >&2
    exit 1
  fi
fi

# The tiny model and its adapters, cached under the digest of the two files that build them.
repo="$(cd "$here/../.." && pwd)"
models="$root/models/$(cat "$here/modeldir.py" "$repo/inferbus/tokens/modeldir.py" | sha256sum | cut -c1-16)"
if [[ ! -f "$models/.built" ]]; then
  rm -rf "$models.tmp"
  PYTHONPATH="$repo" INFERBUS_CACHE_DIR="$root/tokenizers" "$root/bin/python" "$here/modeldir.py" "$models.tmp" >&2
  rm -rf "$models"
  mv "$models.tmp" "$models"
fi

# The stand-in libcuda.so.1, rebuilt when its source changes (sgl_kernel links the driver library).
mkdir -p "$root/cuda-stub"
if [[ ! -f "$root/cuda-stub/libcuda.so.1" || "$here/cuda_stub.c" -nt "$root/cuda-stub/libcuda.so.1" ]]; then
  gcc -shared -fPIC -O2 -o "$root/cuda-stub/libcuda.so.1.tmp" "$here/cuda_stub.c"
  mv "$root/cuda-stub/libcuda.so.1.tmp" "$root/cuda-stub/libcuda.so.1"
fi
echo "$root"
