"""Put Nsight Compute's DRAM byte counts (``ncu --csv --print-units base``) of the kernels that
``kernels/ncu_probe.py`` launched into ``benchmarks.json`` under ``ncu_dram``.

    python3 kernels/ncu_merge.py ncu.csv probe.txt benchmarks.json
"""
import csv
import json
import sys
from pathlib import Path


def main(argv=None):
    argv = argv or sys.argv[1:]
    ncu_csv, probe, dst = (Path(p) for p in argv[:3])
    preds = {}
    for line in probe.read_text().splitlines():
        if line.startswith("PROBE "):
            v = json.loads(line[6:])
            preds[v["name"]] = v
    rows = [ln for ln in ncu_csv.read_text().splitlines() if ln.startswith('"')]
    found = {}
    for rec in csv.DictReader(rows):
        kname = rec.get("Kernel Name", "")
        name = next((n for n in preds if n in kname), None)
        if name is None:
            continue
        value = float(str(rec.get("Metric Value", "0")).replace(",", ""))
        metric = rec.get("Metric Name", "")
        slot = found.setdefault(name, {})
        if metric == "dram__bytes_read.sum":
            slot["read"] = value
        elif metric == "dram__bytes_write.sum":
            slot["write"] = value
        elif metric == "gpu__time_duration.sum":
            slot["ncu_ns"] = value
    res = json.loads(dst.read_text())
    out = {}
    for name, v in found.items():
        if "read" in v and "write" in v:
            out[name] = {"config": preds[name]["config"], "predicted": preds[name]["predicted"], **v}
    if out:
        res["ncu_dram"] = out
        dst.write_text(json.dumps(res, indent=1, default=str))
    print("ncu_dram:", json.dumps(out))


if __name__ == "__main__":
    main()
