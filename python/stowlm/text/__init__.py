"""Text in and out of the model, independent of how it is run: the tokenizer, chat templates,
sampling, the text stream (where generated text ends, and why), constrained decoding (grammar)
and tool calls (toolcalls: the request and its grammar; toolparser: the calls in the output).
Nothing here imports the rest of stowlm."""
