# Sourced by the GPU recipes (examples/*/run_*_gsm8k.sh through gsm8k_gpu_setup.sh, and
# examples/vision_language/run_qwen2_5_vl_3b_geo3k.sh): `prepare_gpu_inputs CONVERTER` writes the data with the
# recipe's converter when $DATA_DIR/train.parquet is missing, and turns a hub id in $MODEL_PATH into the local
# folder huggingface_hub caches (fetched once). Nothing is fetched when the recipe only prints its overrides
# ($PRINT_ONLY=1). Needs PY, DATA_DIR, MODEL_PATH and PRINT_ONLY set.
prepare_gpu_inputs() {
    local converter="$1"
    if [ "$PRINT_ONLY" = 1 ]; then
        return 0
    fi
    if [ ! -f "$DATA_DIR/train.parquet" ]; then
        "$PY" "$converter" --local_dir "$DATA_DIR"
    fi
    if [ ! -d "$MODEL_PATH" ]; then  # a hub id: fetch it once (huggingface_hub caches it), use the folder
        MODEL_PATH="$("$PY" -c 'import sys, huggingface_hub as h; print(h.snapshot_download(sys.argv[1]))' \
            "$MODEL_PATH")"
    fi
}
