#!/usr/bin/env python3
"""Writes the Hugging Face reference ids for moestream's tokenizer conformance test.

Each string of the corpus (a JSON array) is encoded by `tokenizers` from DIR/tokenizer.json with
add_special_tokens=False; transformers.AutoTokenizer on DIR must give the same ids. The output
holds, for every string, its ids and tokenizers' decode(ids, skip_special_tokens=False), plus
the library versions and the SHA-256 of tokenizer.json. It is written as plain ASCII JSON.

Made with tokenizers 0.23 and transformers 5.17 (the versions used are recorded in the output).

  python3 tools/make_tokenizer_refs.py --tokenizer-dir .cache/tokenizer-qwen3 \\
      --corpus tests/fixtures/tokenizer/corpus.json --out tests/fixtures/tokenizer/qwen3_refs.json
"""

import argparse
import hashlib
import json
import pathlib
import sys

import tokenizers
import transformers


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer-dir", required=True, type=pathlib.Path)
    parser.add_argument("--corpus", required=True, type=pathlib.Path)
    parser.add_argument("--out", required=True, type=pathlib.Path)
    args = parser.parse_args()

    tokenizer_json = args.tokenizer_dir / "tokenizer.json"
    corpus = json.loads(args.corpus.read_text(encoding="utf-8"))
    if not isinstance(corpus, list) or not all(isinstance(s, str) for s in corpus):
        sys.exit(f"{args.corpus}: expected a JSON array of strings")

    tok = tokenizers.Tokenizer.from_file(str(tokenizer_json))
    auto = transformers.AutoTokenizer.from_pretrained(str(args.tokenizer_dir))

    cases = []
    for text in corpus:
        ids = tok.encode(text, add_special_tokens=False).ids
        auto_ids = list(auto.encode(text, add_special_tokens=False))
        if auto_ids != ids:
            sys.exit(f"tokenizers and transformers disagree on {text!r}:\n  {ids}\n  {auto_ids}")
        cases.append({"text": text, "ids": ids,
                      "decoded": tok.decode(ids, skip_special_tokens=False)})

    out = {
        "generator": "tools/make_tokenizer_refs.py",
        "versions": {"tokenizers": tokenizers.__version__,
                     "transformers": transformers.__version__},
        "tokenizer_sha256": hashlib.sha256(tokenizer_json.read_bytes()).hexdigest(),
        "cases": cases,
    }
    with open(args.out, "w", encoding="ascii") as f:
        json.dump(out, f, ensure_ascii=True, indent=1)
        f.write("\n")
    print(f"{args.out}: {len(cases)} cases (tokenizers {tokenizers.__version__}, "
          f"transformers {transformers.__version__})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
