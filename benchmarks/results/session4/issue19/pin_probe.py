
import torch, json
out = {}
try:
    t = torch.empty(64 << 20).pin_memory()          # 256 MiB through torch's CachingHostAllocator
    out["pin_memory"] = "ok" if t.is_pinned() else "not pinned"
except Exception as e:
    out["pin_memory"] = f"{type(e).__name__}: {e}"[:200]
try:
    from torch.cuda import _pin_memory_utils
    u = torch.empty(64 << 20)
    _pin_memory_utils.pin_memory(u.data_ptr(), u.numel() * u.element_size())   # cudaHostRegister (offload.py)
    out["host_register"] = "ok" if u.is_pinned() else "not pinned"
except Exception as e:
    out["host_register"] = f"{type(e).__name__}: {e}"[:200]
print(json.dumps(out))
