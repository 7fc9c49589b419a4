"""GGUF files (llama.cpp's format) served as they are: `folder.model_folder` turns a file, a split
set or a name into a model folder the rest of tandem reads like a Hugging Face one (its config
and tokenizer taken from the file's metadata); `reader.read_weights` views the file's tensors
under the engine's names, quantized ones kept in their blocks (engine/layers/quantized/gguf.py).
The file itself is parsed by llama.cpp's own gguf-py."""
