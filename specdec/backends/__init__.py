"""The names of the ways a model can run (kept free of heavy imports: the CLI's --help reads them).

- "hf": transformers (any causal LM, any device);
- "fast": specdec's own Llama forward over the same weights (specdec.backends.fast; same outputs up to
  float rounding, faster on CPU); "fast-bf16": the same with bfloat16 matmul weights (LOSSY
  relative to the float32 model);
- "llamacpp": a GGUF file on llama.cpp (specdec.backends.llamacpp: the embedded default's Q4_1 file, or a
  .gguf path); its outputs are its own (quantized arithmetic), lossless relative to itself;
- "auto": for the embedded default (a GGUF file with float32 weights beside it), whichever of
  "llamacpp" and "fast" serves a typical request faster on this machine, measured once and kept
  (specdec.backends.choice), unless a method needs tree blocks (Lookahead: torch only);
  otherwise "fast" for a float32 Llama-family model on CPU, "hf" for anything else.
"""

BACKENDS = ("auto", "hf", "fast", "fast-bf16", "llamacpp")
