import statistics, time
from e2b import Sandbox
res = {"base": [], "img": []}
for t in ("base", "img"):  # warm: builds base's template snapshot, page cache
    s = Sandbox.create(t, timeout=300); s.commands.run("true"); s.kill()
for i in range(10):
    for t in ("base", "img"):
        t0 = time.monotonic(); s = Sandbox.create(t, timeout=300); dt = (time.monotonic() - t0) * 1000
        s.commands.run("true"); s.kill(); res[t].append(dt)
for t, v in res.items():
    print(t, "p50 %.0f ms" % statistics.median(v), [round(x) for x in v])
print("ratio img/base p50 %.2f" % (statistics.median(res["img"]) / statistics.median(res["base"])))
