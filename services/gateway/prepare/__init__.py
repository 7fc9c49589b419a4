"""A public request made ready for the workers: checked, its messages through the model's chat
template (chat.py), tokenized, its max_tokens resolved and, for structured outputs, its grammar
(structured.py); requests.py turns it into one generation request per prompt and choice."""
