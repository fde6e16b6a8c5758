"""Device check of ddpfab check --perf's GPU path: validate and analyze the node's record."""
import json, sys
import perf
text = open(sys.argv[1]).read()
lines = [ln.split(perf.MARKER, 1)[1] for ln in text.splitlines() if perf.MARKER in ln]
assert len(lines) == 1, f"expected one perf record, found {len(lines)}"
raw = json.loads(lines[0])
print(json.dumps({k: raw[k] for k in ("backend", "device", "compute", "memory", "all_reduce", "all_reduce_skipped", "seconds")}, indent=1))
rep = perf.validate_report("gpu0", raw)
res = perf.analyze({"gpu0": rep}, ["gpu0"])
perf.add_all_reduce(res, {"gpu0": rep}, ["gpu0"])
print(perf.render(res))
assert raw["backend"] == "nccl" and raw["device"] != "cpu"
assert raw["compute"]["dtype"] == "bfloat16" and raw["compute"]["gflops"] > 1000
print("GPU PATH OK")
