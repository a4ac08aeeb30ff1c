# Source on the GPU machine from the repo root: `. benchmarks/remote/setup.sh` (parts made by
# pack.sh). Idempotent across calls on one warm machine: wheels into /tmp/site, carried parts into
# /tmp/xfer (kept answers from .remote/k* too), resources assembled in /tmp/res and linked as
# resources/; `python` runs python3.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p /tmp/site /tmp/xfer /tmp/res/smollm2 /tmp/res/sharegpt /tmp/res/humaneval /tmp/res/code /tmp/bin
for p in a t; do  # a: the workflow's wheels; t: pytest (pack.sh tests), for the gpu tests
  if [ -d .remote/$p/whl ] && [ ! -f /tmp/site/.done-$p ]; then
    python3 -m pip install -q --no-deps --no-index --target /tmp/site .remote/$p/whl/*.whl && touch /tmp/site/.done-$p
  fi
done
[ -x /tmp/bin/python ] || { printf '#!/bin/sh\nexec python3 "$@"\n' > /tmp/bin/python; chmod +x /tmp/bin/python; }
export PATH=/tmp/bin:/tmp/site/bin:$PATH PYTHONPATH=/tmp/site:$PWD/src
# zstd as stream filters (no zstd binary there; the library comes with the carried wheels), for
# this script and those that source it (mon.sh, concurrency.sh); `bundles`: the compile bundles
# this machine holds (/tmp/cc) as one zstd tar on stdout (about 29x smaller), for `pack.sh
# compile` to carry to the next machine
unzst() { python3 -c "import sys, zstandard; zstandard.ZstdDecompressor().copy_stream(sys.stdin.buffer, sys.stdout.buffer)"; }
zst() { python3 -c "import sys, zstandard; zstandard.ZstdCompressor(level=9, threads=-1).copy_stream(sys.stdin.buffer, sys.stdout.buffer)"; }
bundles() { (cd /tmp/cc && tar cf - *.torchcompile 2>/dev/null) | zst; }
for d in .remote/a .remote/b .remote/k* .remote/g*; do [ -d $d ] && find $d -maxdepth 1 -type f -exec cp --update=none {} /tmp/xfer/ \;; done
# torch.compile's bundles: an earlier machine's (pack.sh compile) loaded, this machine's saved here
export DFLASHPIPE_COMPILE_CACHE=/tmp/cc
mkdir -p /tmp/cc
for f in .remote/cc/*.tar.zst; do
  [ -f "$f" ] && unzst < "$f" | tar x --skip-old-files -C /tmp/cc
done
GG=/tmp/res/gemma3/gemma-3-270m-q4_k_m.gguf
if [ ! -f $GG ] && [ "$(ls /tmp/xfer/gemma.gguf.[0-4] 2>/dev/null | wc -l)" = 5 ]; then
  mkdir -p /tmp/res/gemma3 && cat /tmp/xfer/gemma.gguf.[0-4] > $GG.tmp
  if [ "$(sha256sum $GG.tmp | cut -d' ' -f1)" = "$(cat /tmp/xfer/gemma.gguf.sha256)" ]; then mv $GG.tmp $GG
  else echo "setup.sh: the joined Gemma GGUF does not match its sha256; parts left in /tmp/xfer" >&2; rm $GG.tmp; fi
fi
G=/tmp/res/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f $G ] && [ -f /tmp/xfer/gguf.zst.0 ] && [ -f /tmp/xfer/gguf.zst.1 ]; then
  cat /tmp/xfer/gguf.zst.0 /tmp/xfer/gguf.zst.1 | unzst > $G.tmp && mv $G.tmp $G
fi
S=/tmp/res/sharegpt/ShareGPT_V3_unfiltered_cleaned_split.json
if [ ! -f $S ] && [ -f /tmp/xfer/sharegpt.json.zst ]; then
  unzst < /tmp/xfer/sharegpt.json.zst > $S.tmp && mv $S.tmp $S
fi
[ -f /tmp/xfer/HumanEval.jsonl.gz ] && cp --update=none /tmp/xfer/HumanEval.jsonl.gz /tmp/res/humaneval/ || true
for w in /tmp/xfer/*-py3-none-any.whl; do [ -f "$w" ] && cp --update=none "$w" /tmp/res/code/; done
[ -e resources ] || ln -s /tmp/res resources
export QUALITY_RESOURCES=/tmp/res  # quality.py links its runs here, not through resources/
(cd /tmp/res && sha256sum smollm2/* sharegpt/* humaneval/* code/* gemma3/* 2>/dev/null)
true
