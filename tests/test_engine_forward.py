"""Contract: a one-rank engine loaded from an HF checkpoint computes what a plain reference forward
of the same HF weights computes, for every family: prompt logits (batched, right-padded),
KV-cached greedy decoding (tokens and logprobs), prompt logprobs.

The reference (weightsync/engine/reference.py) shares no code with the engine: unfused HF weights,
one prompt at a time, no cache, naive MLA. Tolerances in tests/engine_helpers.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.engine_helpers import (
    FAMILY_MODELS,
    LOGIT_ATOL,
    LOGIT_RTOL,
    LOGPROB_ATOL,
    PROMPTS,
    one_torch_thread,  # noqa: F401 -- autouse fixture
    tiny,
    write_tiny_checkpoint,
)
from weightsync.engine.engine import Engine, GenRequest
from weightsync.engine.reference import Reference, reference_prompt_logprobs
from weightsync.engine.sampling import SamplingParams
from weightsync.engine.tokenizer import ByteTokenizer
from weightsync.engine.tp import EngineGroups


@pytest.fixture(scope="module", params=FAMILY_MODELS)
def loaded(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Engine, Reference]:
    name = request.param
    path = tmp_path_factory.mktemp(name)
    tensors = write_tiny_checkpoint(name, path)
    spec = tiny(name)
    engine = Engine.build(spec, EngineGroups.single(), device=torch.device("cpu"))
    engine.load_checkpoint(str(path))
    return engine, Reference(spec, tensors)


def test_prompt_logits_match_reference(loaded: tuple[Engine, Reference]) -> None:
    engine, ref = loaded
    for prompt, logits in zip(PROMPTS, engine.prompt_logits([list(p) for p in PROMPTS])):
        torch.testing.assert_close(logits, ref.logits(list(prompt)), atol=LOGIT_ATOL, rtol=LOGIT_RTOL)


def test_greedy_decode_with_cache_matches_reference(loaded: tuple[Engine, Reference]) -> None:
    """Batched generation (different prompt lengths and budgets): every token is the reference's
    argmax over the full sequence, and every logprob (prompt and generated) matches."""
    engine, ref = loaded
    reqs = [
        GenRequest(
            rid=str(k),
            input_ids=tuple(p),
            sampling=SamplingParams(max_new_tokens=5 + 2 * k, temperature=0.0),
            return_logprob=True,
            logprob_start_len=0,
        )
        for k, p in enumerate(PROMPTS)
    ]
    for req, res in zip(reqs, engine.generate(reqs)):
        prompt = list(req.input_ids)
        assert len(res.output_ids) == req.sampling.max_new_tokens
        assert res.finish_reason == {"type": "length", "length": req.sampling.max_new_tokens}
        logp = torch.log_softmax(ref.logits(prompt + res.output_ids), dim=-1)
        steps = logp[len(prompt) - 1 : -1]
        assert res.output_ids == steps.argmax(dim=-1).tolist()
        expect_out = steps.gather(1, torch.tensor(res.output_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(res.output_logprobs), expect_out, atol=LOGPROB_ATOL, rtol=0)
        assert res.input_logprobs is not None
        assert res.input_logprobs[0] is None
        expect_in = logp[: len(prompt) - 1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(res.input_logprobs[1:]), expect_in, atol=LOGPROB_ATOL, rtol=0)


def test_seeded_sampling_is_reproducible_and_stops(loaded: tuple[Engine, Reference]) -> None:
    engine, _ = loaded
    sp = SamplingParams(max_new_tokens=6, temperature=0.8, top_p=0.9, top_k=50, sampling_seed=7)
    req = GenRequest(rid="s", input_ids=(3, 1, 4, 1, 5), sampling=sp, return_logprob=True)
    first, second = engine.generate([req])[0], engine.generate([req])[0]
    assert first.output_ids == second.output_ids
    assert len(first.output_ids) == 6
    assert all(lp <= 0.0 for lp in first.output_logprobs)
    stop = first.output_ids[2]
    stopped = engine.generate(
        [
            GenRequest(
                rid="t",
                input_ids=req.input_ids,
                sampling=SamplingParams(
                    max_new_tokens=6, temperature=0.8, top_p=0.9, top_k=50, sampling_seed=7, stop_token_ids=(stop,)
                ),
            )
        ]
    )[0]
    cut = first.output_ids.index(stop) + 1
    assert stopped.output_ids == first.output_ids[:cut]
    assert stopped.finish_reason == {"type": "stop", "matched": stop}
    none = engine.generate([GenRequest(rid="z", input_ids=(1, 2), sampling=SamplingParams(max_new_tokens=0))])[0]
    assert none.output_ids == []
    assert none.finish_reason == {"type": "length", "length": 0}


def test_reference_prompt_logprobs_match_engine(loaded: tuple[Engine, Reference]) -> None:
    """The run's logprob-parity helper (text prompt, byte tokenizer) agrees with the engine."""
    engine, ref = loaded
    text = "What is 12 + 30?"
    ids = ByteTokenizer(engine.spec.vocab_size).encode(text)
    got = reference_prompt_logprobs(engine.spec, lambda n: ref.t[n], None, text)
    req = GenRequest(
        rid="p",
        input_ids=tuple(ids),
        sampling=SamplingParams(max_new_tokens=0),
        return_logprob=True,
        logprob_start_len=0,
    )
    res = engine.generate([req])[0]
    assert got[0] is None
    assert res.input_logprobs[0] is None
    torch.testing.assert_close(torch.tensor(got[1:]), torch.tensor(res.input_logprobs[1:]), atol=LOGPROB_ATOL, rtol=0)
