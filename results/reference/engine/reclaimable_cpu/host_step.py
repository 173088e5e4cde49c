import cProfile, pstats, sys, time
import rimuru
from rimuru.engine.sampling_params import SamplingParams
from rimuru.engine.llm import LLM
pol = sys.argv[1]
from rimuru.models.checkpoint import hub_config
import json, tempfile, pathlib
llm = LLM("qwen3-30b-a3b", executor="modeled", gpu_memory_budget="8GiB", policy=pol, max_num_seqs=64, modeled_step_ms=1.0)
p = SamplingParams(max_tokens=400, ignore_eos=True)
llm.generate([[1,2,3,4]], p, use_tqdm=False)
t=time.perf_counter()
llm.generate([[5,6,7,8],[9,10,11]], p, use_tqdm=False)
dt=time.perf_counter()-t
print(pol, "host ms/step %.4f" % (dt/400*1e3))
if len(sys.argv)>2:
    pr = cProfile.Profile(); pr.enable()
    llm.generate([[5,6,7,8],[9,10,11]], p, use_tqdm=False)
    pr.disable()
    st = pstats.Stats(pr); st.sort_stats("tottime").print_stats(18)
