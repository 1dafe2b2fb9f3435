#!/usr/bin/env python3
"""Write a tiny llama-architecture GGUF model for engine tests.

    make_tiny_gguf.py OUT.gguf [--seed N] [--ctx N] [--pad-mib N]

The model is about 1.5 MB, loads in milliseconds and, decoded greedily, its
next token depends only on the previous token, so tests can assert exact text:

    a b c ... z ' ' a b ...   letters cycle through the space and never stop
    0 1 2 ... 9 </s>          digits count up to 9, then end the generation
    anything else -> a        newline, punctuation, capitals, special tokens

How the weights get there: every token embedding holds a one-hot "successor
class" (1.0 in the dimension reserved for the token that should follow it)
plus small noise elsewhere, and the output matrix reads only those class
dimensions. The transformer blocks are random, so attention and the FFN do
real work, but their output projections are so small that they cannot move
the argmax. A fixed seed makes the file byte-identical on every run.

--pad-mib N makes the file about N MiB larger, for tests of how long a load
takes from the disk. llama.cpp refuses a tensor its architecture does not
name, so the bulk is weights it reads: each block's feed-forward layer becomes
a mixture of 64 experts, as wide as the size asks, of which a token uses one.
Loading reads every expert, but a token reads only one, so decoding stays fast
(about 1,100 tokens/s on one thread for 384 MiB), and the answers stay the same
(the experts' down projections shrink as they widen).

The vocabulary is SentencePiece-style (llama.cpp's "llama" tokenizer): the
specials <unk> <s> </s>, 256 byte-fallback tokens, U+2581 for the space, one
token per printable ASCII character and the ChatML control tokens, with a
ChatML chat template embedded.

Needs the `gguf` package (0.19.0) and numpy.
"""

import argparse
import sys

import gguf
import numpy as np

# llama.cpp token types (LLAMA_TOKEN_TYPE_*).
TYPE_NORMAL = 1
TYPE_UNKNOWN = 2
TYPE_CONTROL = 3
TYPE_BYTE = 6

SPACE = "\u2581"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"

N_EMBD = 128
N_LAYER = 2
N_HEAD = 4
N_HEAD_KV = 2
N_FF = 256
N_CTX = 4096
HEAD_DIM = N_EMBD // N_HEAD

# Scales that keep the answer fixed: the class component (1.0) dominates the
# embedding noise, and the blocks' output projections are far too small to
# compete with the output matrix's class weight.
EMBD_NOISE_STD = 0.05
BLOCK_STD = 0.02
BLOCK_OUT_STD = 0.001
CLASS_LOGIT = 8.0

# Experts of a padded model's feed-forward layers, and how many a token uses.
PAD_EXPERTS = 64
PAD_EXPERTS_USED = 1

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class Vocab:
    """Token pieces with their scores and types, in id order."""

    def __init__(self):
        self.pieces = []
        self.scores = []
        self.types = []
        self.ids = {}

    def add(self, piece, ttype, score=0.0):
        self.ids[piece] = len(self.pieces)
        self.pieces.append(piece)
        self.scores.append(score)
        self.types.append(ttype)

    def __len__(self):
        return len(self.pieces)


def build_vocab():
    vocab = Vocab()
    vocab.add("<unk>", TYPE_UNKNOWN)
    vocab.add("<s>", TYPE_CONTROL)
    vocab.add("</s>", TYPE_CONTROL)
    for byte in range(256):
        vocab.add(f"<0x{byte:02X}>", TYPE_BYTE)
    vocab.add(SPACE, TYPE_NORMAL, score=-1.0)
    for code in range(0x21, 0x7F):
        vocab.add(chr(code), TYPE_NORMAL, score=-2.0)
    vocab.add(IM_START, TYPE_CONTROL)
    vocab.add(IM_END, TYPE_CONTROL)
    return vocab


def successors(vocab):
    """Id of the token that must follow each token id."""
    rules = {}
    ring = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [SPACE]
    for pos, piece in enumerate(ring):
        rules[piece] = ring[(pos + 1) % len(ring)]
    for digit in range(10):
        rules[str(digit)] = str(digit + 1) if digit < 9 else "</s>"
    return [vocab.ids[rules.get(piece, "a")] for piece in vocab.pieces]


class Ffn:
    """The shape of each block's feed-forward layer: `width` hidden units, dense when
    `experts` is 0, else in each of that many experts."""

    def __init__(self, width=N_FF, experts=0):
        self.width = width
        self.experts = experts

    @staticmethod
    def padded(pad_mib):
        """The layer that makes the file about `pad_mib` MiB larger (the tiny model's
        dense one for 0)."""
        if pad_mib == 0:
            return Ffn()
        # A unit of width is a row of gate and up and a column of down, in every expert
        # of every block.
        per_unit = N_LAYER * PAD_EXPERTS * 3 * N_EMBD * np.dtype(np.float32).itemsize
        return Ffn(max(1, round(pad_mib * 2**20 / per_unit)), PAD_EXPERTS)


def build_weights(vocab, rng, ffn=Ffn()):
    follow = successors(vocab)
    # One embedding dimension per distinct successor token.
    class_dim = {tok: dim for dim, tok in enumerate(sorted(set(follow)))}
    n_class = len(class_dim)
    if n_class > N_EMBD:
        sys.exit(f"make_tiny_gguf: {n_class} successor classes do not fit in n_embd {N_EMBD}")

    embd = rng.normal(0.0, EMBD_NOISE_STD, size=(len(vocab), N_EMBD)).astype(np.float32)
    embd[:, :n_class] = 0.0
    for tok, nxt in enumerate(follow):
        embd[tok, class_dim[nxt]] = 1.0

    output = np.zeros((len(vocab), N_EMBD), dtype=np.float32)
    for tok, dim in class_dim.items():
        output[tok, dim] = CLASS_LOGIT

    def random(rows, cols, std=BLOCK_STD):
        return rng.normal(0.0, std, size=(rows, cols)).astype(np.float32)

    def ones():
        return np.ones(N_EMBD, dtype=np.float32)

    def experts(rows, cols, std=BLOCK_STD):
        return rng.normal(0.0, std, size=(ffn.experts, rows, cols)).astype(np.float32)

    # An expert's output sums `width` terms: its down projection's scale keeps the sum as
    # small as the tiny model's.
    down_std = BLOCK_OUT_STD * (N_FF / ffn.width) ** 0.5

    tensors = [
        ("token_embd.weight", embd),
        ("output_norm.weight", ones()),
        ("output.weight", output),
    ]
    for layer in range(N_LAYER):
        blk = f"blk.{layer}"
        tensors += [
            (f"{blk}.attn_norm.weight", ones()),
            (f"{blk}.attn_q.weight", random(N_HEAD * HEAD_DIM, N_EMBD)),
            (f"{blk}.attn_k.weight", random(N_HEAD_KV * HEAD_DIM, N_EMBD)),
            (f"{blk}.attn_v.weight", random(N_HEAD_KV * HEAD_DIM, N_EMBD)),
            (f"{blk}.attn_output.weight", random(N_EMBD, N_HEAD * HEAD_DIM, BLOCK_OUT_STD)),
            (f"{blk}.ffn_norm.weight", ones()),
        ]
        if ffn.experts:
            tensors += [
                (f"{blk}.ffn_gate_inp.weight", random(ffn.experts, N_EMBD)),
                (f"{blk}.ffn_gate_exps.weight", experts(ffn.width, N_EMBD)),
                (f"{blk}.ffn_up_exps.weight", experts(ffn.width, N_EMBD)),
                (f"{blk}.ffn_down_exps.weight", experts(N_EMBD, ffn.width, down_std)),
            ]
        else:
            tensors += [
                (f"{blk}.ffn_gate.weight", random(N_FF, N_EMBD)),
                (f"{blk}.ffn_up.weight", random(N_FF, N_EMBD)),
                (f"{blk}.ffn_down.weight", random(N_EMBD, N_FF, BLOCK_OUT_STD)),
            ]
    return tensors


def write_model(path, vocab, tensors, n_ctx=N_CTX, ffn=Ffn()):
    writer = gguf.GGUFWriter(path, "llama")

    writer.add_name("dsv4-tiny-test")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_context_length(n_ctx)
    writer.add_embedding_length(N_EMBD)
    writer.add_block_count(N_LAYER)
    writer.add_feed_forward_length(ffn.width)
    if ffn.experts:
        writer.add_expert_count(ffn.experts)
        writer.add_expert_used_count(PAD_EXPERTS_USED)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_HEAD_KV)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(vocab))

    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(vocab.pieces)
    writer.add_token_scores(vocab.scores)
    writer.add_token_types(vocab.types)
    writer.add_unk_token_id(vocab.ids["<unk>"])
    writer.add_bos_token_id(vocab.ids["<s>"])
    writer.add_eos_token_id(vocab.ids["</s>"])
    writer.add_eot_token_id(vocab.ids[IM_END])
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    for name, data in tensors:
        writer.add_tensor(name, data)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main():
    parser = argparse.ArgumentParser(description="Write a tiny deterministic llama GGUF for tests.")
    parser.add_argument("out", help="path of the .gguf file to write")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    parser.add_argument(
        "--ctx", type=int, default=N_CTX,
        help=f"training context it declares (default {N_CTX}); llama-server caps a slot's context at it",
    )
    parser.add_argument(
        "--pad-mib", type=int, default=0,
        help="make the file about N MiB larger, as feed-forward experts (default 0: none)",
    )
    args = parser.parse_args()
    if args.pad_mib < 0:
        parser.error("--pad-mib must not be negative")

    ffn = Ffn.padded(args.pad_mib)
    vocab = build_vocab()
    tensors = build_weights(vocab, np.random.default_rng(args.seed), ffn)
    write_model(args.out, vocab, tensors, args.ctx, ffn)
    n_params = sum(data.size for _, data in tensors)
    print(f"make_tiny_gguf: wrote {args.out} (vocab {len(vocab)}, {n_params} parameters)", file=sys.stderr)


if __name__ == "__main__":
    main()
