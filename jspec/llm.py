"""The user-facing API: ``jspec.LLM`` and the one-call ``jspec.generate`` (vLLM style)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence as Seq

from jspec import compile_cache, vllm_args
from jspec.engine.llm_engine import EngineConfig, LLMEngine, RequestOutput
from jspec.metrics_reader import engine_metrics
from jspec.parallel import multihost
from jspec.sampling_params import SamplingParams


class LLM:
    """An engine over one target model (and optionally a drafter).

    ``model=None`` serves the embedded default: the target of jspec's own model family
    (jspec.family, a ~10M Llama trained on the Python stdlib), loaded through the same
    checkpoint path as any HF folder; ``speculative_config={"method": M}`` then takes the
    family's drafter for M.
    """

    def __init__(self, model: str | None = None, *, warmup: bool | None = None, **engine_args):
        """``engine_args``: any field of ``jspec.EngineConfig`` (vLLM's names: dtype,
        max_num_seqs, max_model_len, gpu_memory_utilization, enable_prefix_caching,
        speculative_config, seed, load_format, tokenizer, ...), with EngineConfig's defaults,
        and vLLM's other engine arguments as jspec/vllm_args.py takes them (block_size,
        trust_remote_code, enforce_eager, ...).

        ``warmup``: prepare every step program now, with a progress bar (as vLLM captures its
        CUDA graphs), so that no ``generate`` call compiles; loaded from disk when a process
        before made them. None (default): on an accelerator unless ``enforce_eager``; on a
        CPU a program compiles at its first use instead."""
        if model is None:
            from jspec import family

            model = family.TARGET
        known = {f.name for f in dataclasses.fields(EngineConfig)} - {"model"}
        eager = engine_args.get("enforce_eager")
        engine_args = vllm_args.translate(engine_args, known)
        # several hosts join before anything below starts jax's backend
        defaults = EngineConfig(model="")
        multihost.initialize(*(engine_args.get(k, getattr(defaults, k)) for k in
                               ("nnodes", "node_rank", "master_addr", "master_port")))
        if warmup is None:
            import jax

            warmup = not eager and jax.default_backend() != "cpu"
        compile_cache.enable()
        self.engine = LLMEngine(EngineConfig(model=str(model), **engine_args))
        if warmup:
            self.engine.warmup(progress=True)
        self._next_id = 0

    def follow(self) -> int:
        """On the nodes of node_rank >= 1 of an engine over several hosts (``nnodes`` > 1:
        jspec/parallel/multihost.py): run node 0's steps here until node 0 calls ``close``
        (-> the calls made). Every node builds the same ``LLM``; node 0 generates."""
        return self.engine.follow()

    def close(self):
        """Node 0 of several hosts: the other nodes return from ``follow``. A no-op otherwise."""
        self.engine.close()

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for a prompt or a list of prompts: strings, token-id lists, or vLLM's
        prompt dicts (``jspec.TextPrompt`` / ``jspec.TokensPrompt``, with ``cache_salt``).

        All requests are validated before any is queued, so one bad prompt raises a
        ValueError and leaves the engine (and requests already in it) untouched. A call that
        fails or is interrupted aborts its unfinished requests before it raises.
        Synchronous: safe to call from inside a running event loop (Jupyter, Colab).
        ``use_tqdm`` (True, as vLLM): a progress bar of the finished requests.
        """
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, Seq) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = list(sampling_params) if isinstance(sampling_params, Seq) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        eng = self.engine
        ids = [eng.validate(p, sp) for p, sp in zip(prompts, params)]
        rids = []
        for p, sp, tok in zip(prompts, params, ids):
            rid = f"gen-{self._next_id}"
            self._next_id += 1
            eng.add_request(rid, p, sp, prompt_token_ids=tok)
            rids.append(rid)
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(rids), desc="generating", unit="req")
        pending = set(rids)
        try:
            while pending:
                for out in eng.step():
                    if out.finished and out.request_id in pending:
                        done[out.request_id] = out
                        pending.discard(out.request_id)
                        if bar is not None:
                            bar.update(1)
        except BaseException:  # a failed or interrupted (Ctrl-C) call leaves none of its requests queued
            for rid in pending:
                eng.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [done[r] for r in rids]

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's defaults (generation_config.json's temperature, top_p,
        top_k, min_p, repetition_penalty, max_new_tokens as max_tokens; EngineConfig.generation_config),
        what generate and chat use when given none (vLLM's LLM.get_default_sampling_params)."""
        return SamplingParams(**self.engine.default_sampling)

    def get_tokenizer(self):
        """The engine's Hugging Face tokenizer (None for weights loaded without one)."""
        return self.engine.tokenizer

    @property
    def llm_engine(self) -> LLMEngine:
        """vLLM's name for the engine."""
        return self.engine

    def get_metrics(self) -> list:
        """The engine's counters and gauges as vLLM's ``LLM.get_metrics()`` gives them
        (jspec/metrics_reader.py: Counter, Gauge, Vector), speculative decoding's included."""
        return engine_metrics(self.engine)

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache, as vLLM's (benchmarks call it between runs): False while a
        request is unfinished."""
        return self.engine.reset_prefix_cache()

    def chat(
        self,
        messages,
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} messages) or
        a list of conversations, through the model's chat template, or ``chat_template``
        (a Jinja string) in its place, with ``chat_template_kwargs`` and ``tools`` (OpenAI's
        tool dicts) passed to it; ``continue_final_message`` continues the last message
        instead of answering it (vLLM's LLM.chat)."""
        tok = self.engine.tokenizer
        if tok is None or not (chat_template or getattr(tok, "chat_template", None)):
            raise ValueError("this model has no tokenizer with a chat template: LLM.chat needs one "
                             "(pass chat_template=..., or use LLM.generate with token ids instead)")
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        if not convs or any(not isinstance(c, (list, tuple)) or not c for c in convs):
            raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts, or a list of such lists")
        ids = []
        for conv in convs:
            out = tok.apply_chat_template(list(conv), add_generation_prompt=add_generation_prompt, tokenize=True,
                                          continue_final_message=continue_final_message, tools=tools,
                                          chat_template=chat_template, **(chat_template_kwargs or {}))
            ids.append(list(out["input_ids"] if hasattr(out, "keys") else out))
        return self.generate(ids, sampling_params, use_tqdm=use_tqdm)


def generate(prompts, model: str | None = None, sampling_params=None, speculative_config=None, **engine_args):
    """One call: build an engine, generate, return the outputs."""
    return LLM(model, speculative_config=speculative_config, **engine_args).generate(prompts, sampling_params)
