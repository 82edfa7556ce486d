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
