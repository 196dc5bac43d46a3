"""megatron-core builds a GPTModel on CPU (gloo, world size 1, local spec, CPU initialization).

Runs in a subprocess so that the process group and Megatron's global parallel state never leak
into other tests. Forward passes are not checked: megatron-core 0.16.1 calls
torch.cuda.current_device() in its forward path (rotary embedding, attention buffers).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import sys, warnings
    warnings.filterwarnings("ignore")
    import torch, torch.distributed as dist
    port = int(sys.argv[1])
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    try:
        config = TransformerConfig(
            num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
            gated_linear_unit=True, normalization="RMSNorm", add_bias_linear=False,
            use_cpu_initialization=True, params_dtype=torch.float32,
        )
        model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                         vocab_size=256, max_sequence_length=32)
        for name, p in model.named_parameters():
            print(name, tuple(p.shape), p.device.type)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    """
)


def test_gpt_model_builds_on_cpu_with_gloo(free_port):
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(free_port)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    params = {line.split()[0]: line.split(None, 1)[1] for line in proc.stdout.splitlines() if line.strip()}
    # fused QKV: (q heads + 2 * kv groups) * head_dim = (4 + 2*2) * 16 rows
    assert params["decoder.layers.0.self_attention.linear_qkv.weight"] == "(128, 64) cpu"
    # fused gate/up in linear_fc1
    assert params["decoder.layers.1.mlp.linear_fc1.weight"] == "(256, 64) cpu"
    assert params["decoder.layers.1.mlp.linear_fc2.weight"] == "(64, 128) cpu"
    assert "output_layer.weight" in params
