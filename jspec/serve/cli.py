"""``python -m jspec.serve``: argument parsing, engine construction, uvicorn with graceful
shutdown."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from jspec import envs, family, vllm_args
from jspec.serve.reasoning import REASONING_PARSERS
from jspec.serve.tool_parsers import TOOL_PARSERS

logger = logging.getLogger("jspec.serve")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jspec.serve", formatter_class=_HelpFormatter,
                                description="OpenAI-compatible HTTP server over a jspec engine.")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="HF checkpoint folder, as `vllm serve MODEL` (or --model)")
    p.add_argument("--model", default=None,
                   help="HF checkpoint folder (default: the embedded model family's target, jspec.family)")
    p.add_argument("--tokenizer", default=None, help="folder of the tokenizer (default: the model's)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="model names clients may use, the first in responses and /metrics (default: the model "
                        f"argument as given, as vLLM's; {FAMILY_NAME} when no model is given)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    # engine arguments: the jspec.LLM keyword arguments
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16", "half", "float"],
                   help="auto: the checkpoint's dtype (config.json); half, float: vLLM's names")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: config.json alone, random weights for the target and the drafter (benchmarks)")
    p.add_argument("--max-num-seqs", type=int, default=8, help="most requests running at once")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest sequence, prompt and output (default: the model's max_position_embeddings, at "
                        "most 4096)")
    p.add_argument("--page-size", "--block-size", type=int, default=16, help="tokens per KV page (vLLM: block size)")
    p.add_argument("--num-pages", "--num-gpu-blocks-override", type=int, default=None,
                   help="KV pages (default: from --gpu-memory-utilization)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of each accelerator's memory for the engine: weights, KV cache (not the CPU's)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV pages of a prompt prefix seen before")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per step, decode rows and prefill chunks together (default: 2048 when mixing)")
    p.add_argument("--max-prefill-chunk", type=int, default=256, help="tokens of one prompt per step")
    p.add_argument("--max-num-partial-prefills", type=int, default=2,
                   help="prompts chunked beside the decode rows of one step (0: prefill and decode steps apart)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="devices the model is split over (Megatron-style, one mesh; the drafter: "
                        "speculative_config's draft_tensor_parallel_size, 1 or the same)")
    p.add_argument("--nnodes", type=int, default=1,
                   help="hosts the model spans (with --tensor-parallel-size all their devices): each runs this "
                        "command with its --node-rank; node 0 serves, the others follow its steps")
    p.add_argument("--node-rank", type=int, default=0, help="this host's rank among --nnodes (0 serves)")
    p.add_argument("--master-addr", default="127.0.0.1", help="node 0's address (jax.distributed's coordinator)")
    p.add_argument("--master-port", type=int, default=29500,
                   help="the coordinator's port on node 0; node 0's step channel takes the next one")
    p.add_argument("--speculative-config", type=json.loads, default=None,
                   help='JSON, vLLM\'s keys: method eagle3 | peagle | dflash | draft_model | ngram, the drafter '
                        'folder, e.g. \'{"method": "eagle3", "model": "path/to/drafter", "num_speculative_tokens": 3}\' '
                        'or \'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\'; a model alone '
                        'gets its checkpoint\'s method; a method alone takes the embedded family\'s drafter when the '
                        'target is the family\'s')
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer <key>' on /v1 routes (default: $VLLM_API_KEY, else no key)")
    p.add_argument("--seed", type=int, default=0, help="the engine's sampling seed (a request's seed is its own)")
    p.add_argument("--num-scheduler-steps", type=int, default=1,
                   help="decode steps per device call (tokens fed back on the device)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="dispatch each decode call before reading the previous one (--no-async-scheduling: "
                        "read first)")
    p.add_argument("--max-logprobs", type=int, default=20,
                   help="most log-probabilities a request may ask per token (-1: the vocabulary)")
    p.add_argument("--logprobs-mode", default="raw_logprobs", choices=["raw_logprobs", "processed_logprobs"],
                   help="logprobs of the model's logits, or of those the sampler draws from")
    # server behaviour
    # uvicorn's default (5 s) closes idle keep-alive connections so soon that a loaded
    # client reusing a pooled connection races the close and sees a connection error.
    p.add_argument("--keep-alive-timeout", type=int, default=75,
                   help="seconds an idle HTTP keep-alive connection stays open")
    p.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="on SIGINT/SIGTERM, seconds in-flight requests may run before they are "
                        "aborted (they still end cleanly, finish_reason 'abort')")
    p.add_argument("--warmup", choices=["auto", "on", "off"], default="auto",
                   help="compile every shape bucket before serving (engine.warmup()); auto: on "
                        "except on the CPU backend, where compiling all buckets takes minutes")
    p.add_argument("--warmup-structured-outputs", action="store_true",
                   help="warmup also compiles the steps of batches with structured outputs (JSON schema, "
                        "regex...), which otherwise compile on their first use")
    p.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="usage reports prompt_tokens_details.cached_tokens: prompt tokens the prefix cache served")
    p.add_argument("--generation-config", default="auto",
                   help="default sampling parameters: auto, the model's generation_config.json; vllm, none; or "
                        "a folder holding one (a request's own values take precedence)")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template, or a file holding one, in place of the tokenizer's")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='serve tool_choice "auto" (the default with tools): the model writes its calls in its own '
                        "format, --tool-call-parser reads them back as tool_calls")
    p.add_argument("--tool-call-parser", choices=list(TOOL_PARSERS), default=None,
                   help="the model's tool-call format: hermes (<tool_call> JSON: Qwen 2.5 / Qwen3, Hermes), "
                        "llama3_json (Llama 3.1 / 3.2 JSON calls)")
    p.add_argument("--reasoning-parser", choices=list(REASONING_PARSERS), default=None,
                   help="put a reasoning model's <think>...</think> in the message's reasoning field: qwen3, "
                        "deepseek_r1")
    # The HTTP server as vLLM's flags set it up: CORS (every origin by default, as vLLM),
    # TLS, a path prefix behind a proxy (uvicorn's root_path), the API docs pages.
    p.add_argument("--allowed-origins", type=json.loads, default=["*"], help="CORS: allowed origins (JSON list)")
    p.add_argument("--allowed-methods", type=json.loads, default=["*"], help="CORS: allowed methods (JSON list)")
    p.add_argument("--allowed-headers", type=json.loads, default=["*"], help="CORS: allowed headers (JSON list)")
    p.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    p.add_argument("--ssl-keyfile", default=None, help="TLS: the key file")
    p.add_argument("--ssl-certfile", default=None, help="TLS: the certificate file")
    p.add_argument("--ssl-ca-certs", default=None, help="TLS: the CA certificates file")
    p.add_argument("--ssl-cert-reqs", type=int, default=0, help="TLS: whether a client certificate is required "
                   "(the ssl module's CERT_NONE 0, CERT_OPTIONAL 1, CERT_REQUIRED 2)")
    p.add_argument("--root-path", default=None, help="the path prefix a proxy serves the API under")
    p.add_argument("--disable-fastapi-docs", action="store_true", help="no /docs, /redoc or /openapi.json")
    p.add_argument("--log-level", default="info", help="the server's log level")
    p.add_argument("--uvicorn-log-level", default=None, help="uvicorn's log level (default: --log-level)")
    p.add_argument("--disable-log-stats", action="store_true",
                   help="no periodic throughput line in the log (vLLM's: every 10 s while there is activity; "
                        "VLLM_LOG_STATS_INTERVAL sets the interval)")
    for flag in SERVER_NO_EFFECT:
        p.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    for flag, typ in SERVER_NO_EFFECT_VALUES.items():
        p.add_argument(flag, type=typ, default=None, help=argparse.SUPPRESS)
    # vLLM's engine arguments jspec takes with no effect or at their default only
    # (jspec/vllm_args.py): present in the namespace only when given.
    for key, typ in vllm_args.FLAGS.items():
        if key in SERVER_FLAGS:
            continue
        names = ["--" + key.replace("_", "-")] + SHORT_FLAGS.get(key, [])
        if typ is bool:
            p.add_argument(*names, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                           help=argparse.SUPPRESS)
        else:
            p.add_argument(*names, type=typ, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return p


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help gives each flag's default: its value, unless its help says it in words
    ("(default: ...)") or there is none to give (None, a switch's False)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "(default" in text or action.default is None or action.default is False:
            return text
        return super()._get_help_string(action)


# The served model name when no model is given: the embedded family's target folder's name.
FAMILY_NAME = os.path.basename(family.TARGET)
# vLLM's engine arguments (jspec/vllm_args.py) that the server honours itself.
SERVER_FLAGS = {"disable_log_stats"}
# vLLM's short flags for arguments in jspec/vllm_args.py.
SHORT_FLAGS = {"quantization": ["-q"], "pipeline_parallel_size": ["-pp"], "data_parallel_size": ["-dp"]}
# vLLM server flags about its own logging; jspec logs no requests.
SERVER_NO_EFFECT = ("--disable-log-requests", "--enable-log-requests", "--disable-uvicorn-access-log")
# ... and those of its request logging that take a value
SERVER_NO_EFFECT_VALUES = {"--max-log-len": int}


def http_options(args):
    from jspec.serve.app import HTTPOptions

    return HTTPOptions(allowed_origins=args.allowed_origins, allowed_methods=args.allowed_methods,
                       allowed_headers=args.allowed_headers, allow_credentials=args.allow_credentials,
                       docs=not args.disable_fastapi_docs)


def vllm_engine_args(args) -> dict:
    """The vLLM engine arguments given on the command line, by their keyword names."""
    return {k: v for k, v in vars(args).items() if k in vllm_args.FLAGS and k not in SERVER_FLAGS}


def served_model_names(args) -> list[str] | None:
    """--served-model-name, else the model argument exactly as given (vLLM's default: a
    request names the model as the server was started with it); None without a model (the
    engine's folder name: the family's, FAMILY_NAME)."""
    if args.served_model_name:
        return list(args.served_model_name)
    model = args.model or args.model_tag
    return [model] if model else None


def engine_kwargs(args) -> dict:
    kw = dict(dtype=args.dtype, tokenizer=args.tokenizer, load_format=args.load_format,
              max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
              page_size=args.page_size, num_pages=args.num_pages,
              gpu_memory_utilization=args.gpu_memory_utilization,
              enable_prefix_caching=args.enable_prefix_caching, seed=args.seed,
              max_num_batched_tokens=args.max_num_batched_tokens, max_prefill_chunk=args.max_prefill_chunk,
              max_num_partial_prefills=args.max_num_partial_prefills,
              num_scheduler_steps=args.num_scheduler_steps, async_scheduling=args.async_scheduling,
              max_logprobs=args.max_logprobs, logprobs_mode=args.logprobs_mode,
              tensor_parallel_size=args.tensor_parallel_size, generation_config=args.generation_config,
              nnodes=args.nnodes, node_rank=args.node_rank, master_addr=args.master_addr,
              master_port=args.master_port)
    if args.speculative_config is not None:
        kw["speculative_config"] = args.speculative_config
    if args.warmup_structured_outputs:
        kw["warmup_structured_outputs"] = True
    return {**kw, **vllm_engine_args(args)}


def read_chat_template(value: str) -> str:
    """--chat-template: a file's text, or the Jinja template itself (as vLLM reads it)."""
    if os.path.isfile(value):
        with open(value) as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r}: no such file, and not a Jinja template")


def setup_logging(level: str) -> None:
    """The server's log: one format for jspec's lines, and without jax's noise."""
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("jax._src.xla_bridge").addFilter(_no_libtpu)


def _no_libtpu(record: logging.LogRecord) -> bool:
    """jax's INFO line, on every machine without libtpu, that its TPU backend could not start
    (it then starts the next one; the engine logs the backend it runs on)."""
    msg = record.getMessage()
    return not (record.levelno <= logging.INFO and msg.startswith("Unable to initialize backend 'tpu'")
                and "libtpu.so" in msg)


def served_as(state, args) -> str:
    """The model of the "serving" line: its folder, and the names clients use when they differ."""
    model = args.model or f"{family.TARGET} (the embedded family's target)"
    names = ", ".join(state.model_names)
    return model if state.model_names == [args.model] else f"{model} as {names}"


def describe_drafter(engine) -> str:
    """The engine's drafter for the "serving" line: its method, K, and its folder ("the
    family's" for the embedded family's), or what the n-gram method looks up."""
    spec = getattr(engine, "spec", None)
    if spec is None:
        return "no drafter"
    if spec.model:
        in_family = os.path.dirname(os.path.abspath(spec.model)) == family.ROOT
        where = "the embedded family's drafter" if in_family else f"drafter {spec.model}"
    else:  # the n-gram method: the prompt looked up, no drafter
        where = f"prompt lookup {spec.prompt_lookup_min}..{spec.prompt_lookup_max}"
    return f"speculative decoding: {spec.method}, K={engine.K}, {where}"


def log_shapes(engine) -> str:
    """Log (and return) the compiled step shapes a server can meet: what warmup compiles."""
    from jspec.engine.flat_input import describe_shapes

    line = describe_shapes(engine.warmup_shapes())
    logger.info("step shapes: %s", line)
    return line


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.model_tag is not None and args.model is not None and args.model_tag != args.model:
        parser.error(f"the model is given twice: {args.model_tag!r} and --model {args.model!r}")
    args.model = args.model or args.model_tag
    try:
        chat_template = read_chat_template(args.chat_template) if args.chat_template is not None else None
        stats_interval = None if args.disable_log_stats else envs.VLLM_LOG_STATS_INTERVAL
        vllm_args.check_supported(vllm_engine_args(args))  # before anything loads
        from jspec.serve.app import check_parsers

        check_parsers(args.enable_auto_tool_choice, args.tool_call_parser, args.reasoning_parser)
    except ValueError as e:
        parser.error(str(e))
    setup_logging(args.log_level)
    if args.tool_call_parser is not None and not args.enable_auto_tool_choice:
        # vLLM takes the parser alone too (it reads no reply then): accepted, with a word why
        logger.warning('--tool-call-parser %s without --enable-auto-tool-choice: tool_choice "auto" stays refused',
                       args.tool_call_parser)
    import prometheus_client
    import uvicorn

    from jspec.llm import LLM
    from jspec.serve.app import create_app

    prometheus_client.disable_created_metrics()
    try:
        llm = LLM(args.model, warmup=False, **engine_kwargs(args))  # the server warms up below, per --warmup
    except (ValueError, OSError) as e:  # a bad folder, checkpoint, config key or value: one line, no traceback
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    if chat_template is not None:
        if llm.engine.tokenizer is None:
            parser.error("--chat-template: the model has no tokenizer to apply it with (see --tokenizer)")
        llm.engine.tokenizer.chat_template = chat_template
    log_shapes(llm.engine)
    eager = getattr(args, "enforce_eager", False)  # vLLM's: no graphs captured up front; here no warmup
    if args.warmup == "on" or (args.warmup == "auto" and not eager and _backend() != "cpu"):
        if hasattr(llm.engine, "warmup"):
            import time

            t = time.monotonic()
            llm.engine.warmup(progress=True)
            logger.info("warmup: every shape bucket ready in %.1fs", time.monotonic() - t)
    if args.nnodes > 1:  # jspec/parallel/multihost.py: node 0 serves, the others run its steps
        if args.node_rank:
            logger.info("node %d of %d: following node 0 at %s", args.node_rank, args.nnodes, args.master_addr)
            logger.info("node 0 closed: %d steps followed", llm.follow())
            return 0
        llm.engine.lead()
    app = create_app(llm.engine, served_model_names(args), api_key=args.api_key or envs.VLLM_API_KEY,
                     enable_prompt_tokens_details=args.enable_prompt_tokens_details,
                     enable_auto_tool_choice=args.enable_auto_tool_choice, tool_call_parser=args.tool_call_parser,
                     reasoning_parser=args.reasoning_parser, http=http_options(args),
                     log_stats_interval=stats_interval)
    state = app.state.jspec
    logger.info("serving %s on http://%s:%d (%s; max_model_len=%d, %d KV pages)", served_as(state, args),
                args.host, args.port, describe_drafter(llm.engine), llm.engine.max_model_len, llm.engine.num_pages)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            first = not self.should_exit
            super().handle_exit(sig, frame)
            # uvicorn re-raises captured signals after shutdown (exit status 130/143);
            # a clean drain is a normal exit here.
            self._captured_signals.clear()
            if first:
                state.draining = True
                loop = state.loop._loop
                if loop is not None:
                    loop.call_soon_threadsafe(loop.call_later, args.shutdown_timeout, state.loop.abort_all)

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level or args.log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout + 5, access_log=False,
                            timeout_keep_alive=args.keep_alive_timeout, ssl_keyfile=args.ssl_keyfile,
                            ssl_certfile=args.ssl_certfile, ssl_ca_certs=args.ssl_ca_certs,
                            ssl_cert_reqs=args.ssl_cert_reqs, root_path=args.root_path or "")
    Server(config).run()
    return 0


def _backend() -> str:
    import jax

    return jax.default_backend()


if __name__ == "__main__":
    sys.exit(main())
