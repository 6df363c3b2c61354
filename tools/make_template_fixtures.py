#!/usr/bin/env python3
"""Reference renderings of chat templates by transformers' apply_chat_template.

Reads tests/fixtures/templates/conversations.json (templates, conversations, variants) and the
template files next to it, renders every (template x conversation x variant) case through
transformers' public path and writes tests/fixtures/templates/renderings.json:

  tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=.cache/tokenizer-qwen3/tokenizer.json)
  tokenizer.chat_template = <template source>
  tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                add_generation_prompt=..., **special_tokens, **kwargs)

apply_chat_template builds the template variables as {**tokenizer.special_tokens_map, **kwargs}, so
the special-token strings passed as keyword arguments are what the template sees (a token the
model does not define, e.g. Qwen3's bos_token, is left out and is undefined in the template).

strftime_now() is frozen at conversations.json's "now" by replacing the datetime class that
transformers.utils.chat_template_utils calls; the value strftime_now actually returned is
recorded in "now" of the output (the C++ test renders with that clock).

A case whose rendering raises is recorded with the exception's type and message instead of the
text; one failing case never stops the others. One summary line per template is printed.

Run on the GPU machine (transformers and jinja2 installed, no network needed):
  python3 tools/make_template_fixtures.py
Without transformers, --jinja2 renders with a jinja2 environment configured like transformers'
(for development only; the output then says "renderer": "jinja2-emulation").
"""

import argparse
import datetime as _dt
import json
import os
import sys
import traceback
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "templates")


class _Frozen:
    now = None  # datetime.datetime, set in main()


class FrozenDatetime(_dt.datetime):
    @classmethod
    def now(cls, tz=None):
        t = _Frozen.now
        return cls(t.year, t.month, t.day, t.hour, t.minute, t.second, t.microsecond, tzinfo=tz)

    @classmethod
    def today(cls):
        return cls.now()


def freeze_transformers_clock():
    """Makes transformers' strftime_now() return _Frozen.now. Returns a note on what was patched."""
    try:
        from transformers.utils import chat_template_utils as ctu
    except Exception as e:  # noqa: BLE001
        return f"not patched: cannot import chat_template_utils ({e!r})"
    cur = getattr(ctu, "datetime", None)
    if cur is None:
        return "not patched: chat_template_utils has no 'datetime'"
    if isinstance(cur, types.ModuleType):
        shim = types.SimpleNamespace(**{k: getattr(cur, k) for k in dir(cur) if not k.startswith("__")})
        shim.datetime = FrozenDatetime
        ctu.datetime = shim
        return "patched chat_template_utils.datetime (module) .datetime"
    ctu.datetime = FrozenDatetime
    return "patched chat_template_utils.datetime (class)"


def make_transformers_renderer(tokenizer_file):
    import transformers

    note = freeze_transformers_clock()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=tokenizer_file)

    def render(source, messages, tools, add_generation_prompt, kwargs):
        tok.chat_template = source
        out = tok.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )
        if isinstance(out, list) and len(out) == 1 and isinstance(out[0], str):
            out = out[0]
        if not isinstance(out, str):
            raise RuntimeError(f"apply_chat_template returned {type(out).__name__}, not str")
        return out

    info = {
        "renderer": "transformers",
        "transformers": transformers.__version__,
        "clock_patch": note,
        "tokenizer_special_tokens_map": dict(tok.special_tokens_map),
    }
    return render, info


def make_jinja2_renderer():
    """Development stand-in: jinja2 configured as transformers configures it."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return FrozenDatetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    cache = {}

    def render(source, messages, tools, add_generation_prompt, kwargs):
        if source not in cache:
            cache[source] = env.from_string(source)
        return cache[source].render(
            messages=messages, tools=tools, documents=None, add_generation_prompt=add_generation_prompt, **kwargs
        )

    return render, {"renderer": "jinja2-emulation", "transformers": None}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fixtures", default=FIXTURES, help="directory with conversations.json and the templates")
    ap.add_argument("--tokenizer-file", default=os.path.join(ROOT, ".cache", "tokenizer-qwen3", "tokenizer.json"))
    ap.add_argument("--out", default=None, help="output file (default: FIXTURES/renderings.json)")
    ap.add_argument("--jinja2", action="store_true", help="render with a jinja2 emulation instead of transformers")
    args = ap.parse_args()

    with open(os.path.join(args.fixtures, "conversations.json"), encoding="utf-8") as f:
        spec = json.load(f)
    _Frozen.now = _dt.datetime.fromisoformat(spec.get("now", "2026-01-15T12:00:00"))

    if args.jinja2:
        render, info = make_jinja2_renderer()
    else:
        render, info = make_transformers_renderer(args.tokenizer_file)

    import jinja2

    info["jinja2"] = jinja2.__version__
    info["python"] = sys.version.split()[0]
    # What strftime_now really returns under this renderer (the test renders with this clock).
    try:
        probe = render("{{ strftime_now('%Y-%m-%dT%H:%M:%S') }}", [{"role": "user", "content": "x"}], None, False, {})
    except Exception as e:  # noqa: BLE001
        probe = None
        info["clock_probe_error"] = f"{type(e).__name__}: {e}"
    info["now"] = probe

    cases = []
    total_failures = 0
    for tname, tinfo in spec["templates"].items():
        path = os.path.join(args.fixtures, tname)
        try:
            with open(path, encoding="utf-8") as f:
                source = f.read()
        except OSError as e:
            print(f"{tname}: cannot read template: {e}", flush=True)
            total_failures += 1
            continue
        special = {k: v for k, v in tinfo.get("special_tokens", {}).items() if v is not None}
        variants = list(spec["variants"]) + list(spec.get("extra_variants", {}).get(tname, []))
        n_ok = n_raised = n_failed = 0
        for conv in spec["conversations"]:
            for vi, var in enumerate(variants):
                kwargs = dict(var.get("kwargs", {}))
                case = {
                    "id": f"{tname}|{conv['name']}|{vi}",
                    "template": tname,
                    "conversation": conv["name"],
                    "messages": conv["messages"],
                    "tools": conv.get("tools"),
                    "add_generation_prompt": bool(var.get("add_generation_prompt", False)),
                    "kwargs": kwargs,
                    "special_tokens": special,
                }
                try:
                    # Copies, so that nothing a renderer might change leaks into the next case.
                    msgs = json.loads(json.dumps(conv["messages"]))
                    tools = json.loads(json.dumps(conv.get("tools")))
                    all_kwargs = dict(special)
                    all_kwargs.update(kwargs)
                    case["rendered"] = render(source, msgs, tools, case["add_generation_prompt"], all_kwargs)
                    n_ok += 1
                except Exception as e:  # noqa: BLE001
                    case["error"] = {"type": type(e).__name__, "module": type(e).__module__, "message": str(e)}
                    # Template errors (raise_exception, undefined, type errors) are expected outcomes;
                    # anything that looks like a harness problem is counted separately.
                    if isinstance(e, (ImportError, AttributeError)) and "jinja2" not in type(e).__module__:
                        case["error"]["traceback"] = traceback.format_exc()
                    if type(e).__module__.startswith("jinja2") or isinstance(e, (TypeError, ValueError, KeyError, IndexError, ZeroDivisionError)):
                        n_raised += 1
                    else:
                        n_failed += 1
                        case["error"]["traceback"] = traceback.format_exc()
                cases.append(case)
        total_failures += n_failed
        print(f"{tname}: {n_ok} rendered, {n_raised} raised by the template, {n_failed} unexpected errors", flush=True)

    out = dict(info)
    out["comment"] = "Generated by tools/make_template_fixtures.py from conversations.json; do not edit."
    out["cases"] = cases
    out_path = args.out or os.path.join(args.fixtures, "renderings.json")
    tmp = out_path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, indent=1)
        f.write("\n")
    os.replace(tmp, out_path)
    print(f"wrote {len(cases)} cases to {out_path} ({info['renderer']}, transformers {info['transformers']}, "
          f"jinja2 {info['jinja2']}, now={info['now']})", flush=True)
    return 0 if total_failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
