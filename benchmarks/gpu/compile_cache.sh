#!/usr/bin/env bash
# GPU host, from the repository root: carry vLLM's torch.compile cache and Triton's kernel cache
# from one bare host to the next, so that a server's first start skips the compiles (on a bare
# H200 the 24-layer cut's engine init took 154 s, 15-37 s once the caches were warm).
#   compile_cache.sh restore   before any server starts: unpack the parts carried in .gpu-cache/
#                              (moved to $CC_WORK/cc-parts as they arrive, like the bundle's parts); once per host
#   compile_cache.sh save DIR  pack both caches into DIR/cc-part-0, -1, ... (15 MiB each, at most
#                              $CC_MAX_PARTS, default 4: with the stage archive under the 64 MiB a call returns;
#                              a larger cache is not saved, and says so). xz where the host has it
#                              ($CC_COMPRESSOR: xz or gzip; gzip packed a host's caches to 56-60 MiB),
#                              which restore tells from the first part's magic bytes
# vLLM and Triton key their entries by versions, GPU and source: an entry that does not match is
# not used, and that start compiles as on a bare host. Nothing here can fail a stage.
set -u
work=${CC_WORK:-/tmp}  # where parts wait, the packed archive and the restored marker
vllm_cache=${VLLM_CACHE_ROOT:-$HOME/.cache/vllm}/torch_compile_cache
triton_cache=${TRITON_CACHE_DIR:-/tmp/triton-cache}
case ${1:-} in
  restore)
    mkdir -p "$work"/cc-parts
    mv .gpu-cache/cc-part-* "$work"/cc-parts/ 2> /dev/null
    if [[ -e "$work"/cc-restored ]] || ! ls "$work"/cc-parts/cc-part-* > /dev/null 2>&1; then
      echo "compile cache: nothing to restore"
      exit 0
    fi
    mkdir -p "$vllm_cache" "$triton_cache"
    format=z
    [[ $(head -c 6 "$work"/cc-parts/cc-part-0 | od -An -tx1 | tr -d ' \n') == fd377a585a00 ]] && format=J
    if cat "$work"/cc-parts/cc-part-* | tar "x${format}f" - -C /; then
      touch "$work"/cc-restored
      echo "compile cache: restored $(du -sm "$vllm_cache" | cut -f1) MB of vLLM's, $(du -sm "$triton_cache" | cut -f1) MB of Triton's"
    else
      echo "compile cache: the parts did not unpack; compiling as on a bare host"
    fi
    ;;
  save)
    out=${2:?usage: compile_cache.sh save DIR}
    paths=()
    for p in "$vllm_cache" "$triton_cache"; do [[ -d $p ]] && paths+=("${p#/}"); done
    ((${#paths[@]})) || { echo "compile cache: none on this host"; exit 0; }
    compressor=${CC_COMPRESSOR:-$(command -v xz > /dev/null && echo xz || echo gzip)}
    [[ $compressor == xz ]] && pack=(xz -T0 -6) || pack=(gzip -6)
    set -o pipefail
    tar cf - -C / "${paths[@]}" | "${pack[@]}" > "$work"/cc.pack || { echo "compile cache: packing failed, not saved"; exit 0; }
    size=$(stat -c %s "$work"/cc.pack)
    max=$((${CC_MAX_PARTS:-4} * 15 * 1024 * 1024))
    if ((size > max)); then
      echo "compile cache: $((size >> 20)) MiB packed, over $((max >> 20)) MiB: not saved"
      exit 0
    fi
    split -b 15M -d -a 1 "$work"/cc.pack "$out/cc-part-"
    echo "compile cache: saved $((size >> 20)) MiB ($compressor) in $(ls "$out"/cc-part-* | wc -l) parts"
    ;;
  *)
    echo "usage: compile_cache.sh restore | save DIR" >&2
    exit 2
    ;;
esac
