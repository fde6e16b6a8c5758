set -x
cd "$(dirname "$0")"
nvidia-smi -L
python3 -c "import torch;print(torch.__version__, torch.cuda.is_available(), torch.cuda.nccl.version())"
CFG=$(python3 -c "import json,perf; print(json.dumps(perf.PerfOptions().node_config(1)))")
export PYTHONUNBUFFERED=1
timeout 150 python3 -m torch.distributed.run --nnodes=1 --nproc-per-node=1 --master-addr=127.0.0.1 --master-port=29555 --tee=3 perfnode.py "$CFG" > $OUT/node.log 2>&1; echo "torchrun exit $?"
tail -c 3000 $OUT/node.log
python3 analyze.py $OUT/node.log 2>&1 | tee $OUT/analysis.txt
