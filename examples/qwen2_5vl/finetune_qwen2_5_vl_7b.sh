#!/bin/bash
# MindSpeed MM's Qwen2.5-VL launch (examples/qwen2.5vl/finetune_qwen2_5_vl_7b.sh) in its shape, for
# `lightning-mm migrate`: GPT_ARGS, MM_ARGS (--mm-data, --mm-model) and OUTPUT_ARGS. What differs: the world size,
# TP/PP 1 (FSDP2 shards instead), `--use-torch-fsdp2 --fsdp2-config-path`, paths of the tiny stand-in, and
# model_7b.json, which here is MindSpeed MM's Transformers-route model.json (a Hugging Face checkpoint directory)
# instead of its Megatron one.
source /usr/local/Ascend/cann/set_env.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1
export TASK_QUEUE_ENABLE=2
export HCCL_CONNECT_TIMEOUT=1200

NPUS_PER_NODE=2
MASTER_ADDR=localhost
MASTER_PORT=6000
NNODES=1
NODE_RANK=0
WORLD_SIZE=$(($NPUS_PER_NODE*$NNODES))

MM_DATA="./examples/qwen2_5vl/data_7b.json"
MM_MODEL="./examples/qwen2_5vl/model_7b.json"
SAVE_PATH="./runs/qwen2_5vl/save_dir"
TP=1
PP=1
CP=1
MBS=2
GRAD_ACC_STEP=2
DP=$(($WORLD_SIZE/$TP/$PP/$CP))
GBS=$(($MBS*$GRAD_ACC_STEP*$DP))

DISTRIBUTED_ARGS="
    --nproc_per_node $NPUS_PER_NODE \
    --nnodes $NNODES \
    --node_rank $NODE_RANK \
    --master_addr $MASTER_ADDR \
    --master_port $MASTER_PORT
"

GPT_ARGS="
    --use-mcore-models \
    --tensor-model-parallel-size ${TP} \
    --pipeline-model-parallel-size ${PP} \
    --context-parallel-size ${CP} \
    --context-parallel-algo ulysses_cp_algo \
    --micro-batch-size ${MBS} \
    --global-batch-size ${GBS} \
    --use-torch-fsdp2 \
    --fsdp2-config-path ./examples/qwen2_5vl/fsdp2_config.yaml \
    --lr 2.0e-3 \
    --lr-decay-style cosine \
    --weight-decay 0 \
    --train-iters 40 \
    --lr-warmup-fraction 0.1 \
    --clip-grad 1.0 \
    --adam-beta1 0.9 \
    --adam-beta2 0.999 \
    --seed 42 \
    --bf16 \
    --no-load-optim \
    --no-load-rng \
    --num-workers 0 \
"

MM_ARGS="
    --mm-data $MM_DATA \
    --mm-model $MM_MODEL
"

OUTPUT_ARGS="
    --log-interval 1 \
    --save-interval 40 \
    --eval-interval 40 \
    --eval-iters 2 \
    --save $SAVE_PATH \
    --ckpt-format torch_dcp \
"
torchrun $DISTRIBUTED_ARGS pretrain_vlm.py \
    $GPT_ARGS \
    $MM_ARGS \
    $OUTPUT_ARGS \
    --distributed-backend nccl
