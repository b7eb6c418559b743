"""Run by tests/commands/test_bounded_readers.py in a child process: read one input with upcycle's reader under an
address-space limit of the process's size now plus BUDGET megabytes (RLIMIT_AS, set after the imports, so that the limit
is what the read itself may take). Prints one JSON line: {"error": the UpcycleError's message or null, "count":
items read, "exception": the name of any other exception, "seconds": how long the read took}.

usage: python bounded_worker.py pairs|images|lines PATH BUDGET_MB [IMAGE_SIZE | TOKENIZER_FOLDER]
(lines: the text file read as `upcycle eval --tokens 64` and `convert --calibration-tokens 512` read it)"""

from __future__ import annotations

import json
import resource
import sys


def address_space() -> int:
    """This process's virtual size in bytes (/proc/self/status VmSize)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def main() -> None:
    kind, path, budget = sys.argv[1], sys.argv[2], int(sys.argv[3]) * 2**20
    from upcycle.errors import UpcycleError

    if kind == "pairs":
        from upcycle.data.text_pairs import read_text_pairs

        def read() -> int:
            return len(read_text_pairs(path))
    elif kind == "images":
        from upcycle.data.clip_pairs import read_pairs

        def read() -> int:
            return len(read_pairs(path, image_size=int(sys.argv[4])))
    else:
        from transformers import AutoTokenizer

        from upcycle.config import CalibrationConfig
        from upcycle.data.model_inputs import text_batches
        from upcycle.data.packing import pack_documents
        from upcycle.data.text import read_texts

        tokenizer = AutoTokenizer.from_pretrained(sys.argv[4])

        def read() -> int:
            texts = read_texts(path)
            ids, _ = pack_documents(tokenizer, texts, 32, max_tokens=64)
            batches = text_batches(tokenizer, texts, CalibrationConfig(tokens=512, sequence_length=64))
            return int(ids.numel()) + sum(int(b["attention_mask"].sum()) for b in batches)
    limit = address_space() + budget
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    import time

    result = {"error": None, "count": None, "exception": None}
    started = time.perf_counter()
    try:
        result["count"] = read()
    except UpcycleError as e:
        result["error"] = str(e)
    except BaseException as e:      # noqa: BLE001 - the test reports what escaped
        result["exception"] = type(e).__name__
    result["seconds"] = round(time.perf_counter() - started, 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
