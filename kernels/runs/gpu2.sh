export NUMBA_ENABLE_CUDASIM=0
timeout 400 python3 kernels/probes/document_breakdown.py 2>&1 | grep -v Warning | tee $OUT/breakdown16384.log | tail -n 45
