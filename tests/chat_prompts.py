"""Eight short chat prompts shared by the greedy-equality tests on SmolLM2."""

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in two sentences.",
    "List three prime numbers.",
    "How do I reverse a list in Python?",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 7?",
    "Give me a tip for staying focused.",
]

# Prompts whose answer copies from the prompt (what the prompt-lookup branch catches).
COPY_PROMPTS = ["Repeat exactly, word for word: The quick brown fox jumps over the lazy dog, and then the "
                "dog sleeps under the old oak tree by the river.",
                "Copy this list exactly: apples, pears, plums, cherries, grapes, lemons, limes, oranges."]
