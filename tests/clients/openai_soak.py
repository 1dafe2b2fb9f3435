"""openai_soak.py BASE_URL ITERATIONS [ds4] - the official `openai` client against an
OpenAI-compatible endpoint serving the tiny test model (tests/engine/make_tiny_gguf.py),
ITERATIONS times:

    models.list
    chat.completions.create             max_tokens 8          -> "abcdefgh"
    chat.completions.create stream=True max_tokens 8          -> deltas "abcdefgh"
    completions.create                  "count 5", max_tokens 8 -> "6789"

With `ds4`, the endpoint serves ds4-server's tiny model (../shared/rigs/ds4/gen_ds4_gguf.py),
which answers every chat "Hi!" (finish_reason "stop"); it has no completions.create step.

All on ONE client, so that its connection pool (httpx) reuses the connections as a real
application does. Every request is bounded to 5 s and never retried (max_retries=0: a retry
would hide a broken connection). BASE_URL is the API root, e.g. http://127.0.0.1:8080/v1.

Exits 0 when every answer was exact; 1 on the first failure, with one line naming the iteration,
the request and what went wrong; 2 on a usage error or when the openai package is missing
(tests/clients/prepare makes a venv that has it). The last line on success is a summary:
    openai_soak: OK: N requests in T s (slowest S s: ITERATION/REQUEST)
"""

import signal
import sys
import time

TIMEOUT = 5.0
CHAT = "abcdefgh"
COMPLETION_PROMPT = "count 5"
COMPLETION = "6789"
MESSAGES = [{"role": "user", "content": "hello"}]


class Timeout(Exception):
    pass


def on_alarm(signum, frame):
    raise Timeout(f"no complete answer within {TIMEOUT:g} s")


def fail(message):
    print(f"openai_soak: FAILED: {message}", file=sys.stderr, flush=True)
    sys.exit(1)


def main():
    if len(sys.argv) not in (3, 4) or not sys.argv[2].isdigit() or sys.argv[3:] not in ([], ["ds4"]):
        print(f"usage: {sys.argv[0]} BASE_URL ITERATIONS [ds4]", file=sys.stderr)
        sys.exit(2)
    base_url, iterations = sys.argv[1], int(sys.argv[2])
    ds4 = sys.argv[3:] == ["ds4"]
    answer, finished = ("Hi!", "stop") if ds4 else (CHAT, "length")
    try:
        import openai
    except ImportError as e:
        print(
            f"openai_soak: {sys.executable} has no openai package ({e}): "
            "run tests/clients/prepare and use the python it prints",
            file=sys.stderr,
        )
        sys.exit(2)

    # httpx's timeout bounds each read, not the whole answer: the alarm bounds the whole.
    signal.signal(signal.SIGALRM, on_alarm)
    client = openai.OpenAI(
        base_url=base_url, api_key="sk-unused", timeout=TIMEOUT, max_retries=0
    )
    model = None

    def models():
        nonlocal model
        ids = [m.id for m in client.models.list()]
        if not ids:
            raise AssertionError("models.list() returned no model")
        model = model or ids[0]
        if model not in ids:
            raise AssertionError(f"model {model!r} no longer listed: {ids}")
        return f"{len(ids)} models"

    def chat():
        r = client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=8, temperature=0
        )
        got = r.choices[0].message.content
        if got != answer:
            raise AssertionError(f"content {got!r}, expected {answer!r}")
        return got

    def chat_stream():
        parts, finish = [], None
        for chunk in client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=8, temperature=0, stream=True
        ):
            for choice in chunk.choices:
                parts.append(choice.delta.content or "")
                finish = choice.finish_reason or finish
        got = "".join(parts)
        if got != answer:
            raise AssertionError(f"streamed content {got!r}, expected {answer!r}")
        if finish != finished:
            raise AssertionError(f"finish_reason {finish!r}, expected {finished!r}")
        return got

    def completion():
        r = client.completions.create(
            model=model, prompt=COMPLETION_PROMPT, max_tokens=8, temperature=0
        )
        got = r.choices[0].text
        if got != COMPLETION:
            raise AssertionError(f"text {got!r}, expected {COMPLETION!r}")
        return got

    steps = [
        ("models.list", models),
        ("chat.completions.create", chat),
        ("chat.completions.create(stream=True)", chat_stream),
        ("completions.create", completion),
    ]
    if ds4:
        steps = steps[:3]
    started = time.monotonic()
    slowest = (0.0, "")
    for i in range(1, iterations + 1):
        for name, step in steps:
            t = time.monotonic()
            signal.setitimer(signal.ITIMER_REAL, TIMEOUT)
            try:
                step()
            except Exception as e:
                signal.setitimer(signal.ITIMER_REAL, 0)
                fail(
                    f"iteration {i}/{iterations}, {name}: {type(e).__name__}: {e} "
                    f"(after {time.monotonic() - t:.3f} s)"
                )
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            took = time.monotonic() - t
            if took > slowest[0]:
                slowest = (took, f"{i}/{name}")
    client.close()
    print(
        f"openai_soak: OK: {iterations * len(steps)} requests in "
        f"{time.monotonic() - started:.3f} s (slowest {slowest[0]:.3f} s: {slowest[1]})",
        flush=True,
    )


if __name__ == "__main__":
    main()
