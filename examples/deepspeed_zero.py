"""autosp inside DeepSpeed ZeRO: autosp splits the sequence, DeepSpeed reduces and shards.

    torchrun --nproc-per-node 4 examples/deepspeed_zero.py      # a 2 x 2 (dp x sp) mesh on CPU
                                                                # (2 processes: 1 x 2)
"""

import deepspeed
import torch
import torch.distributed as dist
import transformers
from torch.distributed.device_mesh import init_device_mesh

import autosp

deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
mesh = init_device_mesh("cuda" if torch.cuda.is_available() else "cpu", (dist.get_world_size() // 2, 2),
                        mesh_dim_names=("dp", "sp"))
cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=128, attn_implementation="sdpa")
torch.manual_seed(0)
model = transformers.AutoModelForCausalLM.from_config(cfg)
# partial gradients and a loss global over the mesh: DeepSpeed does the reduction
sp_model = autosp.compile(model, mesh=mesh, runtime=autosp.Runtime(reduce_grads=False))
engine, *_ = deepspeed.initialize(model=sp_model, optimizer=torch.optim.AdamW(sp_model.parameters(), lr=1e-3),
                                  config={"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
                                          "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True})
row = mesh.get_local_rank("dp")
for step in range(2):
    ids = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(10 * step + row))  # this row's
    loss = engine(input_ids=ids, labels=ids, use_cache=False).loss
    engine.backward(loss * dist.get_world_size())     # DeepSpeed averages over N ranks; autosp's partials add up
    engine.step()
    if dist.get_rank() == 0:
        print(f"step {step} loss {loss.item():.5f}")
