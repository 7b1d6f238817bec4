import os

# The benchmarks measure fixed output lengths: the simulated engines they start answer until
# max_tokens, as with ignore_eos (an engine started with --answer-length-median overrides this).
os.environ.setdefault("INFERBUS_SIM_ANSWER_LENGTH_MEDIAN", "0")
