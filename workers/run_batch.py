"""Run a JSONL file of requests through one engine, no Redis: vLLM's `run-batch`.

    python -m workers.run_batch INPUT.jsonl -o OUTPUT.jsonl --model DIR [engine options]
    python -m workers.run_batch -i INPUT.jsonl -o - --model DIR         # results on stdout

Lines are what `producers.submit` accepts (jobs.schemas): OpenAI batch lines for
/v1/completions or /v1/chat/completions, or the short form; with an embedding model
(engine/tasks.py), /v1/embeddings lines. The whole file is
validated first: an invalid line is printed as FILE:LINE: field: message and
nothing runs (exit 1), unless --skip-invalid, which writes an error line for it.
Each request then gets one line in OpenAI's batch output format, written the moment
it finishes (so the output is in finishing order), through the same translation as
the fleet's workers (workers/translate.py). A request that can never run gets its
own error line. An interrupted run (Ctrl-C, SIGTERM) keeps every finished line;
--resume skips the custom ids already in OUTPUT and appends the rest.
"""

from __future__ import annotations

if __name__ == "__main__":  # a CLI start: restart on the chosen malloc before torch loads (stdlib only)
    from workers.allocator import reexec_with_allocator

    reexec_with_allocator()

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from contextlib import nullcontext  # noqa: E402

from tqdm import tqdm  # noqa: E402

from engine import EmbeddingEngine, LLMEngine, ParallelGroupError, StepFailed, create_engine  # noqa: E402
from engine.arg_utils import add_engine_args, engine_config_from_args  # noqa: E402
from engine.cpu_runtime import pin_threads  # noqa: E402
from jobs.results import error_line, success_line  # noqa: E402
from jobs.schemas import MAX_REPORTED_ERRORS, LineError, custom_id_of, parse_line  # noqa: E402
from jobs.tenants import DEFAULT_TENANT  # noqa: E402
from workers.adapters import Adapters, parse_lora_modules  # noqa: E402
from workers.chat_parsers import ChatParsers, add_parser_arguments  # noqa: E402
from workers.translate import (  # noqa: E402
    EmbeddingRequest,
    EngineRequest,
    error_code,
    error_message,
    to_embedding_request,
    to_embedding_response,
    to_engine_request,
    to_result_line,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m workers.run_batch", description=__doc__.split("\n\n")[0])
    parser.add_argument("input", nargs="?", help="the JSONL request file")
    parser.add_argument("-i", "--input-file", dest="input_file", help="the same, as vLLM's run-batch names it")
    parser.add_argument("-o", "--output-file", required=True, help="where result lines go; - for stdout")
    parser.add_argument("--served-model-name", help="the model name in results; default: --model as given")
    parser.add_argument("--skip-invalid", action="store_true", help="write error lines for invalid lines and run the rest")
    parser.add_argument("--resume", action="store_true", help="skip custom ids already in OUTPUT; append the rest")
    parser.add_argument("--lora-modules", nargs="+", metavar="NAME=PATH",
                        help="LoRA adapters (with --enable-lora) a line may name as its body.model")
    add_parser_arguments(parser)
    parser.add_argument("--log-level", default="INFO",
                        help="INFO (default) says what the engine chose: dtype, attention, generation defaults")
    add_engine_args(parser)
    return parser


def lora_adapters(args: argparse.Namespace) -> Adapters | None:
    """The adapters lines may name; ValueError for a malformed --lora-modules or no --enable-lora."""
    modules = parse_lora_modules(args.lora_modules, [args.served_model_name or args.model])
    if modules and not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    return Adapters(modules) if modules else None


def numbered_lines(path: str) -> Iterator[tuple[int, bytes]]:
    with open(path, "rb") as handle:
        for line_number, raw in enumerate(handle, start=1):
            if raw.strip():
                yield line_number, raw


def validate_file(path: str) -> tuple[int, dict[int, LineError]]:
    """Pass 1: (number of requests, line number -> error), duplicates of a custom id included."""
    num_lines, errors, seen = 0, {}, set()
    for line_number, raw in numbered_lines(path):
        num_lines += 1
        try:
            custom_id = parse_line(raw, line_number).custom_id
            if custom_id in seen:
                raise LineError(line_number, "custom_id", f"duplicate custom_id {custom_id!r}")
            seen.add(custom_id)
        except LineError as error:
            errors[line_number] = error
    return num_lines, errors


def finished_custom_ids(path: str) -> set[str]:
    """Custom ids with a complete line in an earlier run's output (a torn last line is ignored)."""
    done = set()
    try:
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                try:
                    done.add(json.loads(line)["custom_id"])
                except (ValueError, KeyError, TypeError):
                    continue
    except FileNotFoundError:
        pass
    return done


class Runner:
    """Feeds requests to the engine as it has room, and writes each result when it finishes."""

    def __init__(self, engine: LLMEngine | EmbeddingEngine, model: str, out, adapters: Adapters | None = None,
                 parsers: ChatParsers | None = None) -> None:
        self.parsers = parsers or ChatParsers()
        self.engine, self.model, self.out, self.adapters = engine, model, out, adapters
        self.is_embedding = engine.task == "embed"
        # engine request id -> (custom_id, request)
        self.pending: dict[str, tuple[str, EngineRequest | EmbeddingRequest]] = {}
        self.num_written = 0
        self.stop_signal: str | None = None  # a SIGTERM or SIGINT that came (stop_on_signals)

    def stop_on_signals(self) -> None:
        """SIGTERM and SIGINT end the run as Ctrl-C does. The signal is kept as well as raised: a
        KeyboardInterrupt that lands inside a __del__ is printed and dropped by Python, and the next
        step raises it again."""
        def on_signal(signum, _frame):
            self.stop_signal = signal.Signals(signum).name
            raise KeyboardInterrupt(self.stop_signal)

        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, on_signal)

    def write(self, line: dict) -> None:
        self.out.write(json.dumps(line, separators=(",", ":")) + "\n")
        self.out.flush()  # a finished line survives whatever happens next
        self.num_written += 1

    def add(self, line_number: int, raw: bytes) -> None:
        request = parse_line(raw, line_number)  # valid: the first pass checked it
        try:
            if self.is_embedding:
                work = to_embedding_request(request)
                self.engine.add_request(str(line_number), work.inputs, work.params)
            else:
                work = to_engine_request(request, self.engine.tokenizer, self.engine.default_sampling_params,
                                         self.parsers)
                model = work.body.model
                lora = self.adapters.request_for(model, DEFAULT_TENANT) if self.adapters and model else None
                self.engine.add_request(str(line_number), work.prompt_token_ids, work.params, lora_request=lora)
        except Exception as error:  # noqa: BLE001 (RequestRejected, can never fit here, or broke on its data)
            self.write(error_line(request.custom_id, error_code(error), error_message(error)))
            return
        self.pending[str(line_number)] = (request.custom_id, work)

    def has_room(self) -> bool:
        """Keep at most one step's worth of requests waiting (of tokens, for embeddings), so
        memory stays bounded."""
        if self.is_embedding:
            return self.engine.num_pending_tokens < self.engine.config.max_num_batched_tokens
        return self.engine.stats().num_waiting < self.engine.config.max_num_seqs

    def step(self) -> None:
        if self.stop_signal is not None:
            raise KeyboardInterrupt(self.stop_signal)
        for output in self.engine.step():
            custom_id, work = self.pending.pop(output.request_id)
            model = work.body.model or self.model
            if output.error is not None:  # its grammar did not compile, or a failed step was traced to it
                self.write(error_line(custom_id, output.error_code or "request_failed", output.error))
            elif self.is_embedding:
                self.write(success_line(custom_id, to_embedding_response(work, output, model)[0]))
            else:
                self.write(to_result_line(custom_id, work, output, model, self.engine.tokenizer)[0])


def start_engine(args: argparse.Namespace) -> tuple[Adapters | None, object]:
    """The adapters and the engine, its start-up log (what it chose) on stderr; ValueError for a
    configuration that cannot run."""
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    pin_threads(args.device, args.tensor_parallel_size)  # on the CPU: one pinned thread per core
    return lora_adapters(args), create_engine(engine_config_from_args(args))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    path = args.input_file or args.input
    if not path or (args.input and args.input_file):
        parser.error("give the input file once: INPUT or -i INPUT")
    try:
        num_lines, errors = validate_file(path)
    except OSError as error:
        print(f"error: {path}: {error.strerror}", file=sys.stderr)
        return 2
    for error in list(errors.values())[:MAX_REPORTED_ERRORS]:
        print(f"{path}:{error}", file=sys.stderr)  # FILE:LINE: field: message
    if len(errors) > MAX_REPORTED_ERRORS:
        print(f"... and {len(errors) - MAX_REPORTED_ERRORS} more invalid lines", file=sys.stderr)
    if errors and not args.skip_invalid:
        print(f"{len(errors)} of {num_lines} lines invalid; nothing ran", file=sys.stderr)
        return 1
    try:
        adapters, engine = start_engine(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    done = finished_custom_ids(args.output_file) if args.resume and args.output_file != "-" else set()
    to_stdout = args.output_file == "-"
    with nullcontext(sys.stdout) if to_stdout else open(args.output_file, "a" if done else "w", encoding="utf-8") as out:
        runner = Runner(engine, args.served_model_name or args.model, out, adapters,
                        ChatParsers.of_engine(engine, args.reasoning_parser, args.tool_call_parser))
        runner.stop_on_signals()
        progress = tqdm(total=num_lines - len(done), unit="req", file=sys.stderr,
                        disable=to_stdout or not sys.stderr.isatty())
        try:
            for line_number, raw in numbered_lines(path):
                if line_number in errors:
                    error = errors[line_number]
                    runner.write(error_line(custom_id_of(raw, line_number), "invalid_request",
                                            f"line {line_number}: {error.field}: {error.message}"))
                    continue
                if done and parse_line(raw, line_number).custom_id in done:
                    continue
                while not runner.has_room():
                    runner.step()
                    progress.update(runner.num_written - progress.n)
                runner.add(line_number, raw)
            while engine.has_unfinished():
                runner.step()
                progress.update(runner.num_written - progress.n)
        except KeyboardInterrupt:
            print(f"interrupted: {runner.num_written} results written to {args.output_file}; "
                  "--resume runs the rest", file=sys.stderr)
            return 130
        except (ParallelGroupError, StepFailed) as error:
            print(f"error: {error}; {runner.num_written} results written to {args.output_file}; "
                  "--resume runs the rest", file=sys.stderr)
            return 1
        finally:
            progress.close()
            engine.shutdown()
    print(f"{runner.num_written} results written to {args.output_file}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
