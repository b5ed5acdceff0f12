"""The ``tokenwire`` command: generate, chat, info, tokenize, health and bench.

Each subcommand is a thin layer over ``tokenwire.Client``; the exit status says how
a call ended (see ``EXIT_CODES`` and ``tokenwire --help``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

import grpc

from tokenwire import formats
from tokenwire.bench import DEFAULT_PROMPTS, ProgressBar, run_bench
from tokenwire.channel import TLSConfig
from tokenwire.client import DEFAULT_TARGET, ChunkStream, Client
from tokenwire.errors import Cancelled, InvalidArgument, TokenwireError
from tokenwire.request import GenerateOptions
from tokenwire.results import Chunk, HealthStatus, Message, Token
from tokenwire.retry import RetryPolicy
from tokenwire.v1 import generation_pb2 as pb

__all__ = ["EXIT_CODES", "exit_code", "main"]

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_FAILED_PRECONDITION = 3
EXIT_UNAVAILABLE = 4
EXIT_OVERLOADED = 5
EXIT_DEADLINE = 6
EXIT_AUTH = 7
EXIT_NOT_FOUND = 8
EXIT_NOT_SERVING = 9
EXIT_INTERRUPTED = 130

EXIT_CODES: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.INVALID_ARGUMENT: EXIT_USAGE,
    grpc.StatusCode.OUT_OF_RANGE: EXIT_USAGE,
    grpc.StatusCode.FAILED_PRECONDITION: EXIT_FAILED_PRECONDITION,
    grpc.StatusCode.UNAVAILABLE: EXIT_UNAVAILABLE,
    grpc.StatusCode.RESOURCE_EXHAUSTED: EXIT_OVERLOADED,
    grpc.StatusCode.DEADLINE_EXCEEDED: EXIT_DEADLINE,
    grpc.StatusCode.UNAUTHENTICATED: EXIT_AUTH,
    grpc.StatusCode.PERMISSION_DENIED: EXIT_AUTH,
    grpc.StatusCode.NOT_FOUND: EXIT_NOT_FOUND,
    grpc.StatusCode.UNIMPLEMENTED: EXIT_NOT_FOUND,
    grpc.StatusCode.CANCELLED: EXIT_INTERRUPTED,
}

EPILOG = f"""\
exit status:
  {EXIT_OK}    success (health: SERVING)
  {EXIT_ERROR}    any other error (INTERNAL, UNKNOWN, ...)
  {EXIT_USAGE}    bad usage or INVALID_ARGUMENT
  {EXIT_FAILED_PRECONDITION}    FAILED_PRECONDITION (e.g. chat on a model without a chat template)
  {EXIT_UNAVAILABLE}    UNAVAILABLE (server unreachable or draining)
  {EXIT_OVERLOADED}    RESOURCE_EXHAUSTED (server full, after retries)
  {EXIT_DEADLINE}    DEADLINE_EXCEEDED (--timeout passed)
  {EXIT_AUTH}    UNAUTHENTICATED or PERMISSION_DENIED
  {EXIT_NOT_FOUND}    NOT_FOUND or UNIMPLEMENTED
  {EXIT_NOT_SERVING}    health: the service is not SERVING
  {EXIT_INTERRUPTED}  interrupted (Ctrl-C) or CANCELLED

environment:
  TOKENWIRE_TARGET  default --target (else {DEFAULT_TARGET})
  TOKENWIRE_TOKEN   bearer token, when --token-file is not given
"""


def exit_code(error: TokenwireError) -> int:
    """The exit status for a failed call."""
    return EXIT_CODES.get(error.code, EXIT_ERROR)


# -- arguments ------------------------------------------------------------------------


def _connection_parser(retries: int = 4) -> argparse.ArgumentParser:
    """The connection flags; one parser per default of --retries (argparse shares a parent's
    actions between its children, so a child's set_defaults would change them all)."""
    parser = argparse.ArgumentParser(add_help=False)
    group = parser.add_argument_group("connection")
    group.add_argument(
        "--target",
        default=os.environ.get("TOKENWIRE_TARGET", DEFAULT_TARGET),
        help="host:port, a gRPC target (dns:///name:port) or comma-separated host:port list "
        "(default: $TOKENWIRE_TARGET or %(default)s)",
    )
    group.add_argument("--tls", action="store_true", help="use TLS (system trust store unless --ca-file)")
    group.add_argument("--ca-file", type=Path, help="PEM root certificates (implies --tls)")
    group.add_argument("--cert-file", type=Path, help="PEM client certificate for mutual TLS (implies --tls)")
    group.add_argument("--key-file", type=Path, help="PEM client key for mutual TLS")
    group.add_argument("--server-name", help="name to check the server's certificate against")
    group.add_argument("--token-file", type=Path, help="file holding a bearer token (default: $TOKENWIRE_TOKEN)")
    group.add_argument("--timeout", type=float, help="deadline of each call in seconds, retries included")
    group.add_argument(
        "--retries",
        type=int,
        default=retries,
        help="retries of a refused call before the first chunk, and resumes of a cut stream after it "
        "(default: 4; bench: 0, so that overload shows as errors)",
    )
    return parser


def _generation_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False)
    group = parser.add_argument_group("generation")
    group.add_argument("--temperature", type=float, help="0 is greedy")
    group.add_argument("--top-k", type=int)
    group.add_argument("--top-p", type=float)
    group.add_argument("--repetition-penalty", type=float)
    group.add_argument("--seed", type=int)
    group.add_argument("--presence-penalty", type=float, help="OpenAI's presence penalty, in [-2, 2]")
    group.add_argument("--frequency-penalty", type=float, help="OpenAI's frequency penalty, in [-2, 2]")
    group.add_argument("--min-p", type=float, help="keep tokens at least this fraction as likely as the best one")
    group.add_argument(
        "--logit-bias", action="append", type=_bias, metavar="ID=BIAS",
        help="add BIAS (in [-100, 100]; -100 bans) to token ID's logit (repeatable)",
    )  # fmt: skip
    group.add_argument("--max-new-tokens", type=int)
    group.add_argument("--min-new-tokens", type=int)
    group.add_argument("--stop", action="append", metavar="TEXT", help="stop sequence (repeatable)")
    group.add_argument(
        "--stop-token-id", action="append", type=int, metavar="ID", dest="stop_token_ids",
        help="token id that ends the answer when generated (repeatable; see `tokenwire tokenize` for ids)",
    )  # fmt: skip
    group.add_argument("--include-stop-sequence", action="store_true")
    group.add_argument("--ignore-eos", action="store_true")
    group.add_argument("--time-limit-ms", type=int)
    group.add_argument(
        "--priority",
        choices=("high", "normal", "low"),
        help="admission order among waiting calls (the server may cap it per tenant)",
    )
    group.add_argument("--adapter", metavar="NAME", help="a LoRA adapter the server has loaded (`tokenwire info`)")
    group.add_argument("--system", metavar="TEXT", help="system message (chat)")
    group.add_argument(
        "--no-resume",
        dest="resume",
        action="store_false",
        help="do not resume a stream cut by its replica (UNAVAILABLE mid-stream) on another replica; fail instead",
    )
    return parser


def build_parser() -> argparse.ArgumentParser:
    connection = _connection_parser()
    generation = _generation_parser()
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="tokenwire",
        description="Talk to a tokenwire server: stream generations, chat, inspect and benchmark it.",
        epilog=EPILOG,
        formatter_class=formatter,
    )
    from tokenwire import __version__

    parser.add_argument("--version", action="version", version=f"tokenwire {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gen = commands.add_parser(
        "generate",
        parents=[connection, generation],
        epilog=EPILOG,
        formatter_class=formatter,
        help="stream the completion of a prompt to stdout",
        description="Stream the completion of PROMPT (or stdin) to stdout as it arrives.",
    )
    gen.add_argument("prompt", nargs="?", help="the prompt; '-' or absent: read stdin")
    gen.add_argument(
        "--chat",
        action="store_true",
        help="send the prompt as a user message (chat template); without it the prompt is raw text, as in the RPC",
    )
    gen.add_argument("--json", action="store_true", help="print one JSON object per chunk")
    gen.add_argument("--token-ids", action="store_true", help="ask for token ids (shown with --json)")
    gen.add_argument("--logprobs", action="store_true", help="ask for log-probabilities (shown with --json)")
    gen.add_argument("--top-logprobs", type=int, metavar="N")
    gen.add_argument(
        "--prompt-logprobs",
        action="store_true",
        help="score the prompt: each prompt token's log-probability, printed to stderr (in the first chunk with "
        "--json); with --max-new-tokens 0 the call only scores",
    )
    gen.add_argument("--prompt-top-logprobs", type=int, metavar="N", help="alternatives per prompt token")
    gen.add_argument(
        "--logprobs-of",
        type=int,
        action="append",
        metavar="ID",
        help="report this token id's log-probability at every position (repeatable; shown with --json)",
    )
    gen.add_argument(
        "--n",
        type=int,
        metavar="N",
        help="N samples of the prompt in one call (sample i uses --seed + i), printed apart",
    )
    gen.add_argument("--request-id")
    gen.add_argument("--usage", action="store_true", help="print the finish reason and usage to stderr")
    formats = gen.add_argument_group(
        "response format (the answer follows it; at most one)"
    ).add_mutually_exclusive_group()
    formats.add_argument("--json-schema", type=Path, metavar="FILE", help="a JSON Schema document ('-': stdin)")
    formats.add_argument("--json-object", action="store_true", help="any JSON object")
    formats.add_argument("--regex", metavar="PATTERN", help="a regular expression the whole answer matches")
    formats.add_argument("--choice", metavar="A,B,C", help="exactly one of these comma-separated options")
    formats.add_argument("--grammar", type=Path, metavar="FILE", help="a grammar: EBNF/GBNF (start rule root) or Lark")

    chat = commands.add_parser(
        "chat",
        parents=[connection, generation],
        epilog=EPILOG,
        formatter_class=formatter,
        help="interactive chat that keeps the conversation",
        description="Chat with the model. Ctrl-C stops an answer; Ctrl-D or /exit quits; "
        "/reset forgets the conversation.",
    )
    chat.set_defaults(chat=True)

    info = commands.add_parser(
        "info",
        parents=[connection],
        epilog=EPILOG,
        formatter_class=formatter,
        help="describe the model and the server's limits",
    )
    info.add_argument("--json", action="store_true")

    adapters = commands.add_parser(
        "adapters",
        parents=[connection],
        epilog=EPILOG,
        formatter_class=formatter,
        help="list, load or unload LoRA adapters (the server's Adapters service)",
    )
    adapters.add_argument("action", choices=("list", "load", "unload"))
    adapters.add_argument("name", nargs="?", help="the adapter's name (load, unload)")
    adapters.add_argument("path", nargs="?", help="load: its folder, relative to the server's --lora-dir")

    tok = commands.add_parser(
        "tokenize", parents=[connection], epilog=EPILOG, formatter_class=formatter, help="show the token ids of a text"
    )
    tok.add_argument("text", help="the text ('-': read stdin)")
    tok.add_argument("--chat", action="store_true", help="tokenize as a user message with the chat template")
    tok.add_argument("--system", metavar="TEXT", help="system message (with --chat)")
    tok.add_argument("--tokens", action="store_true", help="show each token's text")
    tok.add_argument("--offsets", action="store_true", help="show each token's character offsets")
    tok.add_argument("--json", action="store_true")

    score = commands.add_parser(
        "score",
        parents=[connection],
        epilog=EPILOG,
        formatter_class=formatter,
        help="how likely each continuation is after a prompt (log-probabilities, lm-eval style)",
        description="Score each CONTINUATION after PROMPT: the sum of its tokens' log-probabilities, and whether "
        "it is the model's greedy answer. Nothing is generated.",
    )
    score.add_argument("prompt", help="the prompt (raw text, as the RPC reads it)")
    score.add_argument("continuations", nargs="+", metavar="CONTINUATION")
    score.add_argument("--json", action="store_true", help="print one JSON object per continuation")

    health = commands.add_parser(
        "health",
        parents=[connection],
        epilog=EPILOG,
        formatter_class=formatter,
        help="grpc.health.v1 check; exit 0 only when SERVING",
    )
    health.add_argument(
        "--service",
        default="",
        help="service to check ('' is the whole server; tokenwire.v1.TextGeneration is readiness)",
    )

    bench = commands.add_parser(
        "bench",
        parents=[_connection_parser(retries=0)],
        epilog=EPILOG,
        formatter_class=formatter,
        help="drive the server with concurrent streams and report latency and throughput",
        description=f"Send concurrent streams over a set of {len(DEFAULT_PROMPTS)} short chat prompts, "
        "each generating exactly --max-new-tokens tokens (ignore_eos), and report throughput, "
        "TTFT, inter-token and end-to-end latency, and errors by status code.",
    )
    bench.add_argument("--concurrency", "-c", type=int, default=4)
    bench.add_argument("--requests", "-n", type=int, help="requests to send (default: 8 x concurrency)")
    bench.add_argument("--duration", type=float, help="seconds to run (with --requests: whichever ends first)")
    bench.add_argument("--max-new-tokens", type=int, default=64)
    bench.add_argument("--temperature", type=float)
    bench.add_argument("--seed", type=int)
    bench.add_argument("--raw", action="store_true", help="send the prompts as raw text, not chat")
    bench.add_argument("--prompt-file", type=Path, help="one prompt per line instead of the built-in set")
    bench.add_argument("--json", action="store_true", help="print the report as JSON")
    bench.add_argument("--no-progress", action="store_true")
    return parser


class UsageError(Exception):
    pass


def _tls(args: argparse.Namespace) -> bool | TLSConfig:
    if args.ca_file or args.cert_file or args.key_file or args.server_name:
        if (args.cert_file is None) != (args.key_file is None):
            raise UsageError("--cert-file and --key-file go together")
        return TLSConfig(
            root_certificates=args.ca_file,
            client_cert=args.cert_file,
            client_key=args.key_file,
            server_name=args.server_name,
        )
    return bool(args.tls)


def _token(args: argparse.Namespace) -> str | None:
    if args.token_file is not None:
        try:
            return args.token_file.read_text().strip() or None
        except OSError as error:
            raise UsageError(f"cannot read --token-file: {error}") from None
    return os.environ.get("TOKENWIRE_TOKEN") or None


def _target(args: argparse.Namespace) -> str | list[str]:
    target: str = args.target
    if "," in target and "://" not in target and not target.startswith(("ipv4:", "ipv6:", "unix:")):
        return [t.strip() for t in target.split(",") if t.strip()]
    return target


def _client(args: argparse.Namespace) -> Client:
    if args.retries < 0:
        raise UsageError("--retries must be >= 0")
    return Client(
        _target(args),
        tls=_tls(args),
        token=_token(args),
        timeout=args.timeout,
        retry=RetryPolicy(max_attempts=args.retries + 1),
    )


def _bias(text: str) -> tuple[int, float]:
    """``--logit-bias ID=BIAS``."""
    token, sep, bias = text.partition("=")
    try:
        if not sep:
            raise ValueError(text)
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ID=BIAS (a token id and a number), got {text!r}") from None


def _options(args: argparse.Namespace) -> GenerateOptions:
    options: GenerateOptions = {}
    for name in (
        "temperature",
        "top_k",
        "top_p",
        "repetition_penalty",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "min_p",
        "max_new_tokens",
        "min_new_tokens",
        "time_limit_ms",
        "top_logprobs",
        "prompt_top_logprobs",
        "n",
        "request_id",
    ):
        value = getattr(args, name, None)
        if value is not None:
            options[name] = value
    for name in ("include_stop_sequence", "ignore_eos", "token_ids", "logprobs", "prompt_logprobs"):
        if getattr(args, name, False):
            options[name] = True  # type: ignore[literal-required]
    if args.stop:
        options["stop"] = list(args.stop)
    if getattr(args, "logit_bias", None):
        options["logit_bias"] = dict(args.logit_bias)
    if getattr(args, "stop_token_ids", None):
        options["stop_token_ids"] = list(args.stop_token_ids)
    if getattr(args, "logprobs_of", None):
        options["logprobs_of"] = list(args.logprobs_of)
    if getattr(args, "priority", None):
        options["priority"] = args.priority
    if getattr(args, "adapter", None):
        options["adapter"] = args.adapter
    fmt = _response_format(args)
    if fmt is not None:
        options["response_format"] = fmt
    return options


def _response_format(args: argparse.Namespace) -> pb.ResponseFormat | None:
    """The --json-schema/--json-object/--regex/--choice/--grammar flag as a ResponseFormat."""
    schema: Path | None = getattr(args, "json_schema", None)
    if schema is not None:
        return formats.json_schema(sys.stdin.read() if str(schema) == "-" else schema.read_text(encoding="utf-8"))
    if getattr(args, "json_object", False):
        return formats.json_object()
    if getattr(args, "regex", None) is not None:
        return formats.regex(args.regex)
    if getattr(args, "choice", None) is not None:
        return formats.choice([option.strip() for option in args.choice.split(",")])
    grammar: Path | None = getattr(args, "grammar", None)
    if grammar is not None:
        return formats.grammar(grammar.read_text(encoding="utf-8"))
    return None


def _read_arg(value: str | None) -> str:
    if value is None or value == "-":
        return sys.stdin.read()
    return value


def _print_error(error: TokenwireError) -> None:
    print(f"tokenwire: {error}", file=sys.stderr)
    if isinstance(error, InvalidArgument):
        for violation in error.field_violations:
            print(f"  {violation}", file=sys.stderr)
    if error.retry_after is not None:
        print(f"  retry after {error.retry_after:.3g} s", file=sys.stderr)


class CancelOnInterrupt:
    """While a stream is read, Ctrl-C cancels its RPC instead of raising KeyboardInterrupt.

    A KeyboardInterrupt raised at an arbitrary point inside grpc's blocking iteration
    can land in its Cython code while it holds the channel's locks, and the next call
    on that channel then hangs. So SIGINT only sets an event here; a watcher thread
    cancels the stream (grpc's supported way to stop a call from another thread), and
    the reading loop ends with ``Cancelled``. ``interrupted`` says whether it happened.
    """

    def __init__(self, stream: ChunkStream) -> None:
        self.stream = stream
        self.interrupted = threading.Event()
        self._finished = threading.Event()
        self._previous: Any = None
        self._watcher: threading.Thread | None = None

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        self.interrupted.set()

    def _watch(self) -> None:
        while not self._finished.is_set():
            if self.interrupted.wait(0.05):
                self.stream.cancel()
                return

    def __enter__(self) -> CancelOnInterrupt:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
            self._watcher = threading.Thread(target=self._watch, name="tokenwire-interrupt", daemon=True)
            self._watcher.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        self._finished.set()
        if self._watcher is not None:
            self._watcher.join()
            signal.signal(signal.SIGINT, self._previous)
        # The Cancelled that our own cancel caused is the expected end, not an error.
        return self.interrupted.is_set() and (exc_type is None or issubclass(exc_type, Cancelled))


# -- commands -------------------------------------------------------------------------


def cmd_generate(args: argparse.Namespace) -> int:
    prompt = _read_arg(args.prompt)
    options = _options(args)
    with _client(args) as client:
        if args.chat or args.system:
            messages = [Message("system", args.system)] if args.system else []
            messages.append(Message("user", prompt))
            stream = client.generate(messages=messages, resume=args.resume, **options)
        else:
            stream = client.generate(prompt, resume=args.resume, **options)
        last = None
        ended_with_newline = True
        texts: dict[int, list[str]] = {}  # an n-call's samples, each printed apart once it ends
        with stream, CancelOnInterrupt(stream) as guard:
            for chunk in stream:
                last = chunk
                if chunk.prompt_tokens and not args.json:
                    _print_prompt_scores(chunk.prompt_tokens)
                if (args.n or 0) > 1 and not args.json:
                    texts.setdefault(chunk.sample, []).append(chunk.text)
                    if chunk.finish_reason is not None:
                        _print_sample(chunk, "".join(texts[chunk.sample]), args.usage)
                elif args.json:
                    sys.stdout.write(json.dumps(chunk.to_dict(), ensure_ascii=False) + "\n")
                elif chunk.text:
                    sys.stdout.write(chunk.text)
                    ended_with_newline = chunk.text.endswith("\n")
                sys.stdout.flush()
        if guard.interrupted.is_set():
            print(file=sys.stderr)
            return EXIT_INTERRUPTED
        if not args.json and not ended_with_newline and sys.stdout.isatty():
            sys.stdout.write("\n")
        raw = not (args.chat or args.system)
        scoring = options.get("max_new_tokens") == 0
        if raw and not scoring and last is not None and last.usage is not None and last.usage.completion_tokens <= 1:
            _hint_chat(client, last.usage.completion_tokens)
        if args.usage and last is not None and (args.n or 0) <= 1:  # an n-call printed each sample's
            usage = last.usage
            print(f"finish_reason: {last.finish_reason}{_matched(last)}", file=sys.stderr)
            if usage is not None:
                print(
                    f"usage: prompt_tokens={usage.prompt_tokens} cached_prompt_tokens={usage.cached_prompt_tokens} "
                    f"completion_tokens={usage.completion_tokens} resumes={usage.resumes} "
                    f"ttft={usage.time_to_first_token_ms:.1f}ms total={usage.total_time_ms:.1f}ms",
                    file=sys.stderr,
                )
    return EXIT_OK


def _matched(last: Chunk) -> str:
    """The stop that ended a stream, as ``--usage`` prints it after the finish reason ("" for none)."""
    return "" if last.matched_stop is None else f" matched_stop={last.matched_stop!r}"


def _print_sample(last: Chunk, text: str, usage: bool) -> None:
    """One sample of an n-call, once it has ended: a header line, its text; its finish with --usage."""
    finish = f" finish_reason: {last.finish_reason}{_matched(last)}" if usage else ""
    tokens = f" completion_tokens={last.usage.completion_tokens}" if usage and last.usage is not None else ""
    sys.stdout.write(f"--- sample {last.sample}{finish}{tokens}\n{text}\n")
    sys.stdout.flush()


def _print_prompt_scores(tokens: Sequence[Token]) -> None:
    """The scored prompt, to stderr: one line per token (id, log-probability, text, the best alternative)."""
    print("prompt logprobs:", file=sys.stderr)
    for token in tokens:
        logprob = "-" if token.logprob is None else f"{token.logprob:.4f}"
        best = (
            f"  best {token.top_logprobs[0].text!r} {token.top_logprobs[0].logprob:.4f}" if token.top_logprobs else ""
        )
        print(f"  {token.id:>8} {logprob:>9}  {token.text!r}{best}", file=sys.stderr)
    total = sum(t.logprob for t in tokens if t.logprob is not None)
    print(f"  sum {total:.4f} over {len(tokens) - 1} scored tokens", file=sys.stderr)


def cmd_score(args: argparse.Namespace) -> int:
    with _client(args) as client:
        scores = client.score(_read_arg(args.prompt), args.continuations)
    for score in scores:
        if args.json:
            print(json.dumps(score.to_dict(), ensure_ascii=False))
        else:
            greedy = " greedy" if score.is_greedy else ""
            print(f"{score.logprob:10.4f}  {len(score.token_ids):>3} tokens{greedy:<7}  {score.continuation!r}")
    return EXIT_OK


def _hint_chat(client: Client, tokens: int) -> None:
    """An instruct model often ends a raw prompt at once: say why nothing was printed."""
    try:
        has_template = client.model_info().has_chat_template
    except TokenwireError:
        return
    if has_template:
        print(
            f"tokenwire: the model ended this raw prompt after {tokens} token(s). It has a chat template: "
            "send the prompt as a chat message with --chat (or use `tokenwire chat`).",
            file=sys.stderr,
        )


CHAT_HELP = "commands: /exit (or Ctrl-D) quits, /reset forgets the conversation; Ctrl-C stops an answer"


def cmd_chat(args: argparse.Namespace) -> int:
    if sys.stdin.isatty():
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
        if threading.current_thread() is threading.main_thread():
            # An interactive session owns Ctrl-C: it cancels an answer or clears the line.
            # A process started in the background by a non-interactive shell (a CI job,
            # `cmd &` in a script) inherits SIGINT ignored, and Ctrl-C at the prompt
            # would then do nothing.
            signal.signal(signal.SIGINT, signal.default_int_handler)
    options = _options(args)
    start: list[Message] = [Message("system", args.system)] if args.system else []
    history = list(start)
    print(f"tokenwire chat with {args.target}. {CHAT_HELP}", file=sys.stderr)
    with _client(args) as client:
        while True:
            try:
                line = input("> ")
            except EOFError:
                print()
                return EXIT_OK
            except KeyboardInterrupt:
                print()
                continue
            text = line.strip()
            if not text:
                continue
            if text in ("/exit", "/quit"):
                return EXIT_OK
            if text == "/reset":
                history = list(start)
                print("[conversation reset]")
                continue
            if text == "/help":
                print(CHAT_HELP)
                continue
            messages = [*history, Message("user", line)]
            parts: list[str] = []
            try:
                stream = client.generate(messages=messages, resume=args.resume, **options)
                with CancelOnInterrupt(stream) as guard:
                    for chunk in stream:
                        parts.append(chunk.text)
                        sys.stdout.write(chunk.text)
                        sys.stdout.flush()
            except TokenwireError as error:
                print()
                _print_error(error)
                continue
            except KeyboardInterrupt:  # Ctrl-C just before or after the guard
                print("\n[cancelled]")
                continue
            if guard.interrupted.is_set():
                # The answer was cut short: it does not join the conversation.
                print("\n[cancelled]")
                continue
            sys.stdout.write("\n")
            history = [*messages, Message("assistant", "".join(parts))]


def cmd_info(args: argparse.Namespace) -> int:
    with _client(args) as client:
        info = client.model_info()
    if args.json:
        print(json.dumps(info.to_dict(), indent=2))
        return EXIT_OK
    for key, value in info.to_dict().items():
        if isinstance(value, list):
            value = ", ".join(map(str, value)) or "-"
        print(f"{key:<24} {'-' if value is None else value}")
    return EXIT_OK


def cmd_adapters(args: argparse.Namespace) -> int:
    if args.action != "list" and not args.name:
        raise UsageError(f"adapters {args.action} needs the adapter's NAME")
    if args.action == "load" and not args.path:
        raise UsageError("adapters load needs NAME and PATH (relative to the server's --lora-dir)")
    with _client(args) as client:
        if args.action == "list":
            for name, rank in client.adapters().items():
                print(f"{name}\trank {rank}")
        elif args.action == "load":
            print(f"loaded {args.name} (rank {client.load_adapter(args.name, args.path)})")
        else:
            running = client.unload_adapter(args.name)
            print(f"unloaded {args.name} ({running} streams in flight finish with it)")
    return EXIT_OK


def cmd_tokenize(args: argparse.Namespace) -> int:
    text = _read_arg(args.text)
    with _client(args) as client:
        if args.chat or args.system:
            messages = [Message("system", args.system)] if args.system else []
            messages.append(Message("user", text))
            result = client.tokenize(messages=messages, return_tokens=args.tokens, return_offsets=args.offsets)
        else:
            result = client.tokenize(text, return_tokens=args.tokens, return_offsets=args.offsets)
    if args.json:
        print(json.dumps(result.to_dict(), ensure_ascii=False))
        return EXIT_OK
    print(f"count: {result.count}")
    print("ids: " + " ".join(map(str, result.ids)))
    if result.tokens or result.offsets:
        for i, token_id in enumerate(result.ids):
            token = repr(result.tokens[i]) if i < len(result.tokens) else ""
            offset = f"[{result.offsets[i].start}, {result.offsets[i].end})" if i < len(result.offsets) else ""
            print(f"  {i:>4}  {token_id:>8}  {offset:<14} {token}".rstrip())
    return EXIT_OK


def cmd_health(args: argparse.Namespace) -> int:
    timeout = args.timeout if args.timeout is not None else 5.0
    with _client(args) as client:
        status = client.health(args.service, timeout=timeout)
    print(status.value)
    return EXIT_OK if status is HealthStatus.SERVING else EXIT_NOT_SERVING


def cmd_bench(args: argparse.Namespace) -> int:
    if args.concurrency < 1 or (args.requests is not None and args.requests < 1):
        raise UsageError("--concurrency and --requests must be at least 1")
    prompts: Sequence[str] = DEFAULT_PROMPTS
    if args.prompt_file is not None:
        prompts = [p for p in args.prompt_file.read_text().splitlines() if p.strip()]
    bar = None if args.no_progress else ProgressBar(sys.stderr)
    report = run_bench(
        _target(args),
        args.concurrency,
        args.requests,
        args.max_new_tokens,
        duration=args.duration,
        prompts=prompts,
        chat=not args.raw,
        temperature=args.temperature,
        seed=args.seed,
        tls=_tls(args),
        token=_token(args),
        timeout=args.timeout,
        retry=RetryPolicy(max_attempts=args.retries + 1),
        progress=bar,
    )
    if bar is not None:
        bar.finish()
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(report.format())
    return EXIT_OK if report.succeeded else EXIT_ERROR


COMMANDS: dict[str, Any] = {
    "generate": cmd_generate,
    "chat": cmd_chat,
    "info": cmd_info,
    "adapters": cmd_adapters,
    "tokenize": cmd_tokenize,
    "score": cmd_score,
    "health": cmd_health,
    "bench": cmd_bench,
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = COMMANDS[args.command](args)
        return code
    except UsageError as error:
        parser.error(str(error))  # exits with EXIT_USAGE
    except TokenwireError as error:
        _print_error(error)
        return exit_code(error)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # `tokenwire generate ... | head`: the reader left; that is not an error. Point
        # stdout at /dev/null so that the flush at exit does not complain again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK
    except (OSError, ValueError) as error:
        print(f"tokenwire: {error}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
