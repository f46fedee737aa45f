python3 kernels/probes/op_forms.py --case f16,4096,128,0 --rounds 9 --form new= --form before=BEFORE_WAIT=0 > $OUT/bw128.log 2>&1; grep -v -i warn $OUT/bw128.log | tail -5
python3 kernels/probes/op_forms.py --case f16,4096,64,0 --rounds 9 --form new= --form before=BEFORE_WAIT=0 > $OUT/bw64.log 2>&1; grep -v -i warn $OUT/bw64.log | tail -5
python3 -u kernels/verify_backward_gpu.py --jobs 15 > $OUT/verify64.log 2>&1; grep -c "| ok |" $OUT/verify64.log; grep "^|" $OUT/verify64.log | grep -v "| ok |" | tail -3
python3 -u kernels/verify_backward_gpu.py --jobs 15 --d 128 > $OUT/verify128.log 2>&1; grep -c "| ok |" $OUT/verify128.log; grep "^|" $OUT/verify128.log | grep -v "| ok |" | tail -3
