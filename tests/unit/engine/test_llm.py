"""LLM.generate's loop over a scripted core (no model)."""

from __future__ import annotations

import pytest

from engine.config import ConfigError, EngineConfig
from engine.llm import LLM, Prompt, _apply_overrides
from engine.models.loader import load_tokenizer, resolve_model
from engine.outputs import EngineCoreOutputs
from engine.sampling_params import SamplingParams
from tests.unit.engine.scripted_core import ScriptedCore


class InterruptedCore(ScriptedCore):
    """Its first step fails midway, leaving the requests it had stuck for
    good (as a step interrupted inside the model leaves the scheduler)."""

    stuck: set[str]

    def step(self) -> EngineCoreOutputs:
        if self.steps == 0:
            self.steps += 1
            self.stuck = set(self.live)
            raise KeyboardInterrupt
        outputs = super().step()
        outputs.outputs = [o for o in outputs.outputs if o.request_id not in self.stuck]
        return outputs


def test_generate_returns_each_prompt_s_output_in_order() -> None:
    core = ScriptedCore()
    llm = LLM.around(core, load_tokenizer(resolve_model(None)))  # type: ignore[arg-type]
    prompts: list[str | list[int]] = [[5, 6], "Hello"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False)
    assert [o.token_ids for o in outs] == [[42, 42], [42, 42]]
    assert [o.prompt for o in outs] == [None, "Hello"]
    assert all(o.finish_reason == "length" for o in outs)
    assert llm.totals.num_steps == 2


def test_vllm_s_dict_prompts_alone_and_in_a_list() -> None:
    llm = LLM.around(ScriptedCore(), load_tokenizer(resolve_model(None)))  # type: ignore[arg-type]
    params = SamplingParams(max_tokens=1)
    alone = llm.generate({"prompt_token_ids": [5, 6]}, params, use_tqdm=False)
    assert len(alone) == 1 and alone[0].prompt_token_ids == [5, 6]
    prompts: list[Prompt] = [{"prompt": "Hello"}, {"prompt_token_ids": [7]}, "Hi"]
    listed = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt for o in listed] == ["Hello", None, "Hi"]


def test_a_call_after_an_interrupted_one_waits_only_for_its_own() -> None:
    core = InterruptedCore()
    llm = LLM.around(core, load_tokenizer(resolve_model(None)))  # type: ignore[arg-type]
    with pytest.raises(KeyboardInterrupt):
        llm.generate([5, 6], SamplingParams(max_tokens=2), use_tqdm=False)
    (out,) = llm.generate([7, 8], SamplingParams(max_tokens=2), use_tqdm=False)
    assert out.request_id == "offline-1" and out.token_ids == [42, 42]


def test_quantization_options_reach_the_model_config() -> None:
    """LLM(quantization=..., int8_activations=...) routes them to ModelConfig."""
    config = _apply_overrides(
        EngineConfig(), None, {"quantization": "int8", "int8_activations": True}
    )
    assert (config.model.quantization, config.model.int8_activations) == ("int8", True)
    assert EngineConfig().model.quantization == "auto"
    with pytest.raises(ConfigError, match="quantization='q4' is invalid"):
        _apply_overrides(EngineConfig(), None, {"quantization": "q4"})
