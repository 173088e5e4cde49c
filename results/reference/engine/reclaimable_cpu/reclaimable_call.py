import time, torch
torch.set_num_threads(1)
import rimuru
from rimuru.memory import KV
llm = rimuru.LLM("/tmp/tinyck", gpu_memory_budget="520MiB", policy="elastic", device="cpu", dtype="float32")
a = llm.kv.allocator
c = a._l3(KV); parent = a._classes[c.parent]
print("L2 parents", parent.num_slots, "KV slots", c.num_slots)
n=2000
t=time.perf_counter()
for _ in range(n): llm.kv.reclaimable_l2_pages()
print("reclaimable us/call %.2f" % ((time.perf_counter()-t)/n*1e6))
t=time.perf_counter()
for _ in range(n): llm._compaction_due()
print("_compaction_due us/call %.2f" % ((time.perf_counter()-t)/n*1e6))
