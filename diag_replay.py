import time, traceback, torch, trainstream
import trainstream.profiler as prof
from trainstream.testing import llama, causal_lm_loss
from trainstream.timing import mark, seconds

def replay(self):
    args, kwargs, (autocast, dtype) = self._inputs
    self._inputs = None
    try:
        self._model.eval()
        for i in range(3):
            with torch.no_grad(), torch.autocast("cuda", dtype=dtype, enabled=autocast):
                t = time.perf_counter(); start = mark(self.device); self._model(*args, **kwargs); end = mark(self.device)
            end.synchronize()
            print("replay", i, seconds(start, end), "wall", time.perf_counter() - t, flush=True)
        return seconds(start, end)
    except Exception:
        traceback.print_exc()
        return None
    finally:
        self._model.train()
prof.StepProfiler._replay_seconds = replay
orig_t = prof.StepProfiler.timings
def timings(self, marks=None):
    r = orig_t(self, marks); print("timings forward_s", r["forward_s"], flush=True); return r
prof.StepProfiler.timings = timings
with torch.device("cuda"):
    m = llama(vocab=32000, hidden=2048, layers=16, heads=16, seq=1024, intermediate=5632)
opt = torch.optim.AdamW(m.parameters(), lr=1e-4, weight_decay=0.01)
m, opt = trainstream.wrap(m, opt, max_grad_norm=1.0, vram_budget="19GB")
tok = torch.randint(0, 32000, (4, 1024), device="cuda")
for i in range(5):
    torch.cuda.synchronize(); t = time.perf_counter()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = causal_lm_loss(m, tok)
    loss.backward(); opt.step(); opt.zero_grad(); opt.synchronize(); torch.cuda.synchronize()
    print("step", i, time.perf_counter() - t, flush=True)
with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
    for i in range(3):
        torch.cuda.synchronize(); t = time.perf_counter(); m(input_ids=tok); torch.cuda.synchronize()
        print("plain no_grad fwd", time.perf_counter() - t, flush=True)
print(opt.describe())
