set -x
export NUMBA_ENABLE_CUDASIM=0
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -c "import torch, numba; print(torch.__version__, numba.__version__)"
timeout 280 python3 kernels/probes/document_training.py 2>&1 | grep -v Warning | tee $OUT/doc4096.log | tail -n 14
timeout 280 python3 kernels/probes/document_training.py --n 16384 --heads 16 2>&1 | grep -v Warning | tee $OUT/doc16384.log | tail -n 14
