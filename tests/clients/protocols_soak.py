"""protocols_soak.py - the official `anthropic` and `openai` packages on the APIs beside
OpenAI chat, against dsv4d in front of an engine serving a tiny test model.

    protocols_soak.py soak BASE_URL ITERATIONS [ds4]
        Each step ITERATIONS times in a row, one step after the other, on one client each
        (their connection pools reuse connections as an application's do):
            anthropic messages.create                     max_tokens 8  -> "abcdefgh"
            anthropic messages.stream                     max_tokens 8  -> "abcdefgh"
            anthropic messages.count_tokens                             -> input_tokens > 0
            openai responses.create                       max_output_tokens 8 -> "abcdefgh"
            openai responses.create stream=True           max_output_tokens 8 -> "abcdefgh"
        With `ds4`, the engine is ds4-server's tiny model (../shared/rigs/ds4/gen_ds4_gguf.py),
        which answers "Hi!" (after a thinking block, max_tokens 16), and has no count_tokens
        route: that step is left out.
        The last line on success is one JSON object: per step its requests and the token
        counts the SDK read from each answer's usage, summed (input: all prompt tokens, cache
        reads and writes included; cached: the cache reads; output).

    protocols_soak.py keys BASE_URL KEY
        With API keys configured in dsv4d: the anthropic package with KEY as its api_key (it
        sends `x-api-key`, and here `anthropic-version: 2023-06-01` and
        `anthropic-beta: dsv4-test-beta`) and the openai package
        with KEY (it sends `Authorization: Bearer`) are answered; the anthropic package with
        KEY as its auth_token (`Authorization: Bearer`) and another key in an `x-api-key` header
        (this version of the package refuses `api_key` and `auth_token` together, and drops its
        own `x-api-key` beside an `Authorization` header) gets 400,
        raised as its BadRequestError; with a wrong key, 401 as its AuthenticationError.
        Prints `keys: OK` on success.

Every request is bounded to 5 s and never retried (max_retries=0). BASE_URL is the server's
root, e.g. http://127.0.0.1:8080 (the openai client is given BASE_URL/v1).

Exits 0 when every answer was right; 1 on the first failure, with one line naming the step,
the request and what went wrong; 2 on a usage error or a missing package (tests/clients/prepare
makes a venv with both).
"""

import json
import signal
import sys
import time

TIMEOUT = 5.0
MESSAGES = [{"role": "user", "content": "hello"}]
BETA = "dsv4-test-beta"
VERSION = "2023-06-01"
# This version of the anthropic package takes no `temperature` argument: sent in the body.
ZERO = {"temperature": 0}


class Timeout(Exception):
    pass


def on_alarm(signum, frame):
    raise Timeout(f"no complete answer within {TIMEOUT:g} s")


def fail(message):
    print(f"protocols_soak: FAILED: {message}", file=sys.stderr, flush=True)
    sys.exit(1)


def usage_error():
    print(
        f"usage: {sys.argv[0]} soak BASE_URL ITERATIONS [ds4] | keys BASE_URL KEY",
        file=sys.stderr,
    )
    sys.exit(2)


def packages():
    try:
        import anthropic
        import openai
    except ImportError as e:
        print(
            f"protocols_soak: {sys.executable} lacks a package ({e}): run "
            "tests/clients/prepare and use the python it prints",
            file=sys.stderr,
        )
        sys.exit(2)
    return anthropic, openai


def bounded(name, step):
    """Runs step() within TIMEOUT; fails naming `name`."""
    t = time.monotonic()
    signal.setitimer(signal.ITIMER_REAL, TIMEOUT)
    try:
        return step()
    except Exception as e:
        signal.setitimer(signal.ITIMER_REAL, 0)
        fail(f"{name}: {type(e).__name__}: {e} (after {time.monotonic() - t:.3f} s)")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def text_of(blocks):
    return "".join(b.text for b in blocks if b.type == "text")


def soak(base_url, iterations, ds4):
    anthropic, openai = packages()
    answer, max_tokens = ("Hi!", 16) if ds4 else ("abcdefgh", 8)
    stop = "end_turn" if ds4 else "max_tokens"
    a = anthropic.Anthropic(
        base_url=base_url, api_key="sk-unused", timeout=TIMEOUT, max_retries=0
    )
    o = openai.OpenAI(
        base_url=f"{base_url}/v1", api_key="sk-unused", timeout=TIMEOUT, max_retries=0
    )
    model = "tiny"

    def anthropic_counts(u):
        cached = u.cache_read_input_tokens or 0
        written = u.cache_creation_input_tokens or 0
        return (u.input_tokens + cached + written, cached, u.output_tokens)

    def messages():
        r = a.messages.create(
            model=model, max_tokens=max_tokens, messages=MESSAGES, extra_body=ZERO
        )
        if text_of(r.content) != answer:
            raise AssertionError(f"content {r.content!r}, expected {answer!r}")
        if r.stop_reason != stop:
            raise AssertionError(f"stop_reason {r.stop_reason!r}, expected {stop!r}")
        return anthropic_counts(r.usage)

    def messages_stream():
        with a.messages.stream(
            model=model, max_tokens=max_tokens, messages=MESSAGES, extra_body=ZERO
        ) as s:
            got = "".join(s.text_stream)
            final = s.get_final_message()
        if got != answer or text_of(final.content) != answer:
            raise AssertionError(f"streamed {got!r} ({final.content!r}), expected {answer!r}")
        if final.stop_reason != stop:
            raise AssertionError(f"stop_reason {final.stop_reason!r}, expected {stop!r}")
        return anthropic_counts(final.usage)

    def count_tokens():
        r = a.messages.count_tokens(model=model, messages=MESSAGES)
        if r.input_tokens <= 0:
            raise AssertionError(f"input_tokens {r.input_tokens}")
        return None

    def responses_counts(u):
        cached = u.input_tokens_details.cached_tokens if u.input_tokens_details else 0
        return (u.input_tokens, cached or 0, u.output_tokens)

    def responses():
        r = o.responses.create(
            model=model, input="hello", max_output_tokens=max_tokens, temperature=0
        )
        if r.output_text != answer:
            raise AssertionError(f"output_text {r.output_text!r}, expected {answer!r}")
        if r.status != "completed":
            raise AssertionError(f"status {r.status!r}")
        return responses_counts(r.usage)

    def responses_stream():
        deltas, completed = [], None
        for event in o.responses.create(
            model=model,
            input="hello",
            max_output_tokens=max_tokens,
            temperature=0,
            stream=True,
        ):
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
            elif event.type == "response.completed":
                completed = event.response
        got = "".join(deltas)
        if got != answer:
            raise AssertionError(f"streamed {got!r}, expected {answer!r}")
        if completed is None or completed.output_text != answer:
            raise AssertionError(f"no response.completed with the answer: {completed!r}")
        return responses_counts(completed.usage)

    steps = [
        ("messages", messages),
        ("messages_stream", messages_stream),
        ("count_tokens", count_tokens),
        ("responses", responses),
        ("responses_stream", responses_stream),
    ]
    if ds4:
        steps = [s for s in steps if s[0] != "count_tokens"]
    signal.signal(signal.SIGALRM, on_alarm)
    report, started = {}, time.monotonic()
    for name, step in steps:
        sums = {"requests": 0, "input": 0, "cached": 0, "output": 0}
        for i in range(1, iterations + 1):
            counts = bounded(f"{name} {i}/{iterations}", step)
            sums["requests"] += 1
            if counts is not None:
                for k, v in zip(("input", "cached", "output"), counts):
                    sums[k] += v
        report[name] = sums
    a.close()
    o.close()
    report["seconds"] = round(time.monotonic() - started, 3)
    print(json.dumps(report), flush=True)


def keys(base_url, key):
    anthropic, openai = packages()
    signal.signal(signal.SIGALRM, on_alarm)

    def anthropic_client(**kw):
        return anthropic.Anthropic(
            base_url=base_url, timeout=TIMEOUT, max_retries=0, **kw
        )

    def anthropic_answered():
        r = anthropic_client(api_key=key).messages.create(
            model="tiny",
            max_tokens=8,
            messages=MESSAGES,
            extra_headers={"anthropic-version": VERSION, "anthropic-beta": BETA},
        )
        if text_of(r.content) != "abcdefgh":
            raise AssertionError(f"content {r.content!r}")

    def openai_answered():
        c = openai.OpenAI(
            base_url=f"{base_url}/v1", api_key=key, timeout=TIMEOUT, max_retries=0
        )
        r = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8)
        if r.choices[0].message.content != "abcdefgh":
            raise AssertionError(f"content {r.choices[0].message.content!r}")

    def refused(error, extra_headers=None, **kw):
        def step():
            try:
                anthropic_client(**kw).messages.create(
                    model="tiny", max_tokens=8, messages=MESSAGES, extra_headers=extra_headers
                )
            except error as e:
                return e
            raise AssertionError(f"answered, expected {error.__name__}")

        return step

    bounded("anthropic with x-api-key", anthropic_answered)
    bounded("openai with Authorization: Bearer", openai_answered)
    two = bounded(
        "anthropic with x-api-key and Authorization",
        refused(
            anthropic.BadRequestError,
            auth_token=key,
            extra_headers={"X-Api-Key": f"{key}-other"},
        ),
    )
    wrong = bounded(
        "anthropic with a wrong key",
        refused(anthropic.AuthenticationError, api_key=key + "-wrong"),
    )
    print(f"keys: OK ({two.status_code}: {two.message}; {wrong.status_code})", flush=True)


def main():
    args = sys.argv[1:]
    if len(args) in (3, 4) and args[0] == "soak" and args[2].isdigit() and args[3:] in ([], ["ds4"]):
        soak(args[1].rstrip("/"), int(args[2]), args[3:] == ["ds4"])
    elif len(args) == 3 and args[0] == "keys":
        keys(args[1].rstrip("/"), args[2])
    else:
        usage_error()


if __name__ == "__main__":
    main()
