#!/usr/bin/env python3
"""Writes the seed corpora fuzz/corpus/<target>/ from tests/fixtures (and a few hand-written
inputs). Run from the repository root; the output is committed, so this only needs running again
when the fixtures change. Everything stays small: safetensors seeds keep a few tensors of each
fixture's header with zeroed data, tokenizer seeds use the small fixture tokenizers
and cut-down copies of the large ones."""
import glob
import hashlib
import json
import os
import re
import struct

OUT = "fuzz/corpus"


def put(target, data, name=None):
    if isinstance(data, str):
        data = data.encode()
    os.makedirs(f"{OUT}/{target}", exist_ok=True)
    name = name or hashlib.sha1(data).hexdigest()[:16]
    with open(f"{OUT}/{target}/{name}", "wb") as f:
        f.write(data)


DTYPE_SIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
              "U32": 4, "F8_E4M3": 1, "F8_E5M2": 1, "BOOL": 1}


def safetensors_seeds():
    for path in sorted(glob.glob("tests/fixtures/*/*/*.safetensors")):
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
        meta = header.pop("__metadata__", None)
        small = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][1] - kv[1]["data_offsets"][0])[:4]
        out, offset = {}, 0
        if meta is not None:
            out["__metadata__"] = meta
        for name, t in small:
            size = t["data_offsets"][1] - t["data_offsets"][0]
            out[name] = {"dtype": t["dtype"], "shape": t["shape"], "data_offsets": [offset, offset + size]}
            offset += size
        h = json.dumps(out, separators=(",", ":")).encode()
        h += b" " * (-len(h) % 8)
        put("safetensors", struct.pack("<Q", len(h)) + h + bytes(offset))
    # Hand-made edge cases: empty header, a zero-sized tensor, every dtype.
    for h in [b"{}", b'{"__metadata__":{"format":"pt"}}', b'{"a":{"dtype":"F32","shape":[0,4],"data_offsets":[0,0]}}']:
        put("safetensors", struct.pack("<Q", len(h)) + h)
    out, offset = {}, 0
    for dt, size in DTYPE_SIZE.items():
        out["t." + dt] = {"dtype": dt, "shape": [2], "data_offsets": [offset, offset + 2 * size]}
        offset += 2 * size
    h = json.dumps(out).encode()
    put("safetensors", struct.pack("<Q", len(h)) + h + bytes(offset))


def hf_config_seeds():
    for path in sorted(glob.glob("tests/fixtures/*/*/config.json")):
        config = open(path, "rb").read()
        gen = os.path.join(os.path.dirname(path), "generation_config.json")
        put("hf_config", config + (b"\0" + open(gen, "rb").read() if os.path.exists(gen) else b""))


def small_tokenizer(tok, merges=64):
    """The tokenizer with its components as they are but a vocab cut down to the ids below 259
    (added tokens and the byte alphabet) and the tokens of its first `merges` usable merges:
    libFuzzer cuts an input at -max_len (64 KB), so a whole 8k-token vocab only ever arrived as
    a truncated, malformed file, and large seeds make every mutation slow."""
    model = tok["model"]
    full = model["vocab"]
    vocab = {t: i for t, i in full.items() if i < 259}
    kept = []
    for m in model["merges"]:
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        if a in vocab and b in vocab and a + b in full:
            vocab[a + b] = full[a + b]
            kept.append(m)
            if len(kept) == merges:
                break
    model["vocab"], model["merges"] = vocab, kept
    return json.dumps(tok, ensure_ascii=False, indent=1).encode()


def tokenizer_seeds():
    texts = ["Hello world! 123", "<|im_start|>user\nhi<|im_end|>", "  a  b\n\n\tc é 中文 🙂", "<s>[INST] x [/INST]"]
    for path in sorted(glob.glob("tests/fixtures/**/tokenizer.json", recursive=True)):
        tok = open(path, "rb").read()
        if len(tok) > 16384:
            tok = small_tokenizer(json.loads(tok))
        cfg_path = os.path.join(os.path.dirname(path), "tokenizer_config.json")
        cfg = open(cfg_path, "rb").read() if os.path.exists(cfg_path) else b"{}"
        put("tokenizer", tok)
        for t in texts[:2]:
            put("tokenizer", tok + b"\0" + t.encode() + b"\0" + cfg)
    # Minimal tokenizers with other components (the unit tests' shapes).
    vocab = {"a": 0, "b": 1, "ab": 2, "<unk>": 3, "▁": 4, "▁a": 5}
    for pre, norm, dec in [
        ({"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}, None, {"type": "ByteLevel"}),
        ({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": True}, {"type": "NFKC"},
         {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": True}),
        ({"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True},
                                                {"type": "Split", "pattern": {"Regex": "\\s+"}, "behavior": "Isolated", "invert": False}]},
         {"type": "Sequence", "normalizers": [{"type": "NFD"}, {"type": "Lowercase"}, {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
         {"type": "Sequence", "decoders": [{"type": "ByteFallback"}, {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}),
    ]:
        tok = {"version": "1.0", "truncation": None, "padding": None,
               "added_tokens": [{"id": 6, "content": "<s>", "single_word": False, "lstrip": False, "rstrip": False,
                                 "normalized": False, "special": True}],
               "normalizer": norm, "pre_tokenizer": pre, "post_processor": None, "decoder": dec,
               "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                         "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                         "vocab": vocab, "merges": ["a b", ["▁", "a"]]}}
        put("tokenizer", json.dumps(tok, ensure_ascii=False).encode() + b"\0ab a 12 <s>b\0{\"add_bos_token\": true, \"bos_token\": \"<s>\"}")


def tokenizer_encode_seeds():
    corpus = json.load(open("tests/fixtures/tokenizer/corpus.json"))
    items = corpus if isinstance(corpus, list) else corpus.get("texts", list(corpus.values()))
    for s in items:
        if isinstance(s, str):
            put("tokenizer_encode", s)
        elif isinstance(s, dict) and isinstance(s.get("text"), str):
            put("tokenizer_encode", s["text"])


def jinja_seeds():
    for path in sorted(glob.glob("tests/fixtures/templates/*.jinja")):
        put("jinja", open(path, "rb").read())
    src = open("tests/jinja_test.cpp", encoding="utf-8").read()
    for source, variables in re.findall(r'R"J\((.*?)\)J",\s*R"J\((.*?)\)J"', src, re.S):
        put("jinja", source.encode() + b"\0" + variables.encode())


def pack_seeds():
    def tensor(role, dtype, shape, offset, extra=None):
        size = DTYPE_SIZE.get(dtype, 1)
        n = size
        for d in shape:
            n *= d
        t = {"role": role, "dtype": dtype, "shape": shape, "offset": offset, "nbytes": n}
        t.update(extra or {})
        return t, offset + (n + 63) // 64 * 64

    def expert(fmt, file, index, parts):
        tensors, off = [], 0
        for p in parts:
            t, off = tensor(*p[:3], off, p[3] if len(p) > 3 else None)
            tensors.append(t)
        size = (off + 4095) // 4096 * 4096
        return {"file": file, "offset": index * size, "size": size, "xxh64": "0123456789abcdef",
                "format": fmt, "tensors": tensors}

    plain = [("gate", "BF16", [8, 16]), ("up", "BF16", [8, 16]), ("down", "BF16", [16, 8])]
    q4 = []
    for role, rows, cols in [("gate", 8, 64), ("up", 8, 64), ("down", 64, 8 * 8)]:
        q4 += [(role, "U32", [rows, cols * 4 // 32], {"bits": 4, "group_size": 32}),
               (role + ".scales", "BF16", [rows, cols // 32]), (role + ".biases", "BF16", [rows, cols // 32])]
    mx = []
    for role, rows, cols in [("gate", 8, 64), ("up", 8, 64), ("down", 64, 64)]:
        mx += [(role, "U8", [rows, cols // 2], {"bits": 4, "group_size": 32, "scheme": "mxfp4"}),
               (role + ".scales", "U8", [rows, cols // 32])]
    biased = plain + [("gate_bias", "F32", [1, 8]), ("up_bias", "F32", [1, 8]), ("down_bias", "F32", [1, 16])]
    fp8 = []
    for role, rows, cols in [("gate", 8, 128), ("up", 8, 128), ("down", 128, 8)]:
        fp8 += [(role, "F8_E4M3", [rows, cols], {"bits": 8, "group_size": 128, "scheme": "fp8"}),
                (role + ".scales", "F32", [(rows + 127) // 128, (cols + 127) // 128])]
    for fmt, parts in [("bf16", plain), ("q4g32", q4), ("mxfp4", mx), ("bf16", biased), ("mixed", fp8)]:
        layers = [[], [expert(fmt, 0, e, parts) for e in range(2)], [expert(fmt, 1, e, parts) for e in range(2)]]
        m = {"format": "moestream-pack", "version": 1, "created_by": "moestream", "source": "fuzz",
             "model_type": "qwen3_moe", "weights": "weights.safetensors",
             "expert_files": ["experts/layer-1.bin", "experts/layer-2.bin"], "n_experts": 2, "layers": layers}
        put("pack_manifest", json.dumps(m, indent=1))


def api_seeds():
    tool = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    chat = [
        {"model": "m", "messages": [{"role": "user", "content": "Hi"}]},
        {"messages": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
         "temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "seed": 7, "max_tokens": 32, "stop": ["\n", "END"],
         "stream": True, "stream_options": {"include_usage": True}, "n": 1, "response_format": {"type": "json_object"}},
        {"messages": [{"role": "user", "content": "Weather in Paris?"},
                      {"role": "assistant", "content": None, "reasoning_content": "call it",
                       "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                      {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "sunny"}],
         "tools": [tool], "tool_choice": "auto", "max_completion_tokens": 64, "chat_template_kwargs": {"enable_thinking": False},
         "reasoning_effort": "low", "repetition_penalty": 1.1},
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "assistant", "content": "<think>x</think>a"},
                      {"role": "user", "content": "v"}], "tools": [tool], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
        {"messages": [{"role": "user", "content": "x"}], "logprobs": False, "presence_penalty": 0, "frequency_penalty": 0,
         "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}},
        {"messages": [{"role": "user", "content": "Weather?"}], "tools": [dict(tool, function=dict(tool["function"], strict=True))],
         "tool_choice": "required", "parallel_tool_calls": False, "logprobs": True, "top_logprobs": 3, "n": 2,
         "logit_bias": {"0": -100, "15": 5.5}},
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": 8, "response_format": {"type": "json_schema", "json_schema": {
            "name": "p", "strict": True, "schema": {"type": "object", "properties": {"a": {"type": "array", "items": {"enum": [1, "b"]}, "minItems": 1}},
                                                    "required": ["a"], "additionalProperties": False}}}},
        # Longer than the fuzz targets' context of 512 tokens with max_tokens: the context shift.
        {"messages": [{"role": "system", "content": "Be brief."}] +
                     [{"role": r, "content": f"turn {i}: " + "words " * 40} for i in range(8) for r in ("user", "assistant")] +
                     [{"role": "user", "content": "last"}], "max_tokens": 100},
    ]
    for b in chat:
        put("openai_chat", json.dumps(b, ensure_ascii=False))
    completions = [
        {"model": "m", "prompt": "Once upon a time", "max_tokens": 16},
        {"prompt": ["The capital of France is"], "temperature": 0, "stop": "\n", "stream": True, "stream_options": {"include_usage": True}},
        {"prompt": [1, 2, 3, 4], "max_tokens": 4, "seed": -1, "top_k": 0, "echo": False, "suffix": None},
        {"prompt": "héllo <|im_start|> wörld", "top_p": 0.5, "min_p": 0.1, "repetition_penalty": 1.2, "n": 1, "logprobs": None},
        {"prompt": "a", "n": 3, "best_of": 3, "logprobs": 2, "logit_bias": {"7": 1}, "max_tokens": 600},
    ]
    for b in completions:
        put("openai_completions", json.dumps(b, ensure_ascii=False))
    atool = {"name": "get_weather", "description": "Weather of a city.",
             "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
    messages = [
        {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "Hi"}]},
        {"max_tokens": 32, "system": "Be brief.", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}],
         "temperature": 0.5, "top_p": 0.9, "top_k": 10, "stop_sequences": ["END"], "stream": True},
        {"max_tokens": 100, "system": [{"type": "text", "text": "sys"}], "tools": [atool], "tool_choice": {"type": "auto"},
         "thinking": {"type": "enabled", "budget_tokens": 1024},
         "messages": [{"role": "user", "content": "Weather in Paris?"},
                      {"role": "assistant", "content": [{"type": "thinking", "thinking": "call", "signature": ""},
                                                        {"type": "text", "text": "Let me check."},
                                                        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
                      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]}]},
        {"max_tokens": 8, "tools": [atool], "tool_choice": {"type": "none"}, "thinking": {"type": "disabled"},
         "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}, {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text", "text": "r"}]}]}]},
        {"max_tokens": 16, "tools": [atool], "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
         "messages": [{"role": "user", "content": "Weather in Paris?"}], "logit_bias": {"3": -1}},
        # Longer than the fuzz targets' context of 512 tokens with max_tokens: the context shift.
        {"max_tokens": 100, "system": "sys", "tools": [atool], "tool_choice": {"type": "any"},
         "messages": [{"role": r, "content": f"turn {i}: " + "words " * 40} for i in range(8) for r in ("user", "assistant")] +
                     [{"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Oslo"}}]},
                      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2", "content": "snow"}, {"type": "text", "text": "and?"}]}]},
    ]
    for b in messages:
        put("anthropic_messages", json.dumps(b, ensure_ascii=False))


if __name__ == "__main__":
    safetensors_seeds()
    hf_config_seeds()
    tokenizer_seeds()
    tokenizer_encode_seeds()
    jinja_seeds()
    pack_seeds()
    api_seeds()
