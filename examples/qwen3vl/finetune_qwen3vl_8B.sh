#!/bin/bash
# MindSpeed MM's Qwen3-VL FSDP2 launch (examples/qwen3vl/finetune_qwen3vl_8B.sh), kept in its shape for
# `lightning-mm migrate`; only the world size and the paths of the tiny stand-in differ. Ascend's environment
# variables stay as MindSpeed MM writes them: migrate reports them and leaves them out.
source /usr/local/Ascend/cann/set_env.sh
export CUDA_DEVICE_MAX_CONNECTIONS=2
export TASK_QUEUE_ENABLE=2
export HCCL_CONNECT_TIMEOUT=1200
export TOKENIZERS_PARALLELISM=false

NPUS_PER_NODE=2
MASTER_ADDR=localhost
MASTER_PORT=6000
NNODES=1
NODE_RANK=0
WORLD_SIZE=$(($NPUS_PER_NODE*$NNODES))

DISTRIBUTED_ARGS="
    --nproc_per_node $NPUS_PER_NODE \
    --nnodes $NNODES \
    --node_rank $NODE_RANK \
    --master_addr $MASTER_ADDR \
    --master_port $MASTER_PORT
"

logfile=$(date +%Y%m%d)_$(date +%H%M%S)
config_path=examples/qwen3vl/qwen3vl_full_sft_8B.yaml
mkdir -p logs
torchrun $DISTRIBUTED_ARGS pretrain_transformers.py ${config_path} \
    --distributed-backend nccl \
    2>&1 | tee logs/train_${logfile}.log
