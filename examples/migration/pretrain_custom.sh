#!/bin/bash
# A MindSpeed MM FSDP2 launch, as the migration guide writes it (kept for `lightning-mm migrate`).
export CUDA_DEVICE_MAX_CONNECTIONS=2
NPUS_PER_NODE=2
NNODES=1
DISTRIBUTED_ARGS="
    --nproc_per_node $NPUS_PER_NODE \
    --nnodes $NNODES \
    --node_rank 0 \
    --master_addr localhost \
    --master_port 6000
"
GPT_ARGS="
    --use-torch-fsdp2 \
    --fsdp2-config-path ./fsdp2_config.yaml \
    --untie-embeddings-and-output-weights \
    --micro-batch-size 4 \
    --global-batch-size 16 \
    --lr 1.0e-4 \
    --min-lr 1.0e-5 \
    --lr-decay-style cosine \
    --lr-warmup-iters 10 \
    --weight-decay 0.01 \
    --clip-grad 1.0 \
    --train-iters 100 \
    --bf16 \
    --seed 1234
"
OUTPUT_ARGS="
    --log-interval 1 \
    --save-interval 50 \
    --eval-interval 50 \
    --eval-iters 5 \
    --save ./ckpt \
    --load ./ckpt \
    --ckpt-format torch_dcp \
    --no-load-optim
"
torchrun $DISTRIBUTED_ARGS pretrain_custom.py \
    $GPT_ARGS \
    $OUTPUT_ARGS \
    --mm-data ./data.json \
    --distributed-backend nccl
