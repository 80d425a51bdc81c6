# Sourced by the device scripts (gpu-suite.sh, device-bench.sh) after they set KAIROS_CACHE_DIR:
# unpacks a CUBIN cache compiled ahead of time on the development machine (`kairos kernels compile
# --cache-dir .carry-cubin`, gzipped to fit the device tool's carry limit, carried along) into the
# cache, which saves the device the minutes of compiling the tensor-core modules. CUBIN_CARRY names
# the folder (default .carry-cubin); without it nothing happens and the device compiles as before.
CUBIN_CARRY=${CUBIN_CARRY:-.carry-cubin}
if [ -d "$CUBIN_CARRY" ]; then
    mkdir -p "$KAIROS_CACHE_DIR"
    for f in "$CUBIN_CARRY"/*; do
        case "$f" in
        *.gz) t="$KAIROS_CACHE_DIR/$(basename "$f" .gz)"; [ -e "$t" ] || gunzip -c "$f" >"$t" ;;
        *) cp -n "$f" "$KAIROS_CACHE_DIR"/ ;;
        esac
    done
    echo "CUBIN cache: $(ls "$CUBIN_CARRY" | wc -l) images from $CUBIN_CARRY"
fi
