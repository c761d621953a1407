"""Labelled query pairs for the semantic cache (seed 000's risk: near-duplicates with different
answers). `True`: a paraphrase, the cached answer is right; `False`: a near-duplicate whose
answer differs, a hit would be a wrong answer. Used by tests/answer_cache/test_semantic.py and
benchmarks/bench_semantic_cache.py."""

PAIRS: list[tuple[str, str, bool]] = [
    # paraphrases: the same answer
    ("How do I delete a file?", "How can I remove a file?", True),
    ("What is the capital of France?", "Which city is the capital of France?", True),
    ("How do I reverse a list in Python?", "How can I reverse a Python list?", True),
    ("What time zone is Tokyo in?", "Which time zone does Tokyo use?", True),
    ("How many days are in a leap year?", "How many days does a leap year have?", True),
    ("How do I reset my password?", "How can I reset my password?", True),
    ("What is the boiling point of water?", "At what temperature does water boil?", True),
    ("Who wrote Pride and Prejudice?", "Who is the author of Pride and Prejudice?", True),
    ("How do I convert a string to an integer in Python?", "How to turn a string into an int in Python?", True),
    ("What is the speed of light?", "How fast does light travel?", True),
    ("How do I undo the last git commit?", "How can I undo my last commit in git?", True),
    ("What does HTTP status 404 mean?", "What is the meaning of HTTP error 404?", True),
    # near-duplicates: a different answer
    ("How do I delete a file?", "How do I delete a folder?", False),
    ("What is the capital of France?", "What is the capital of Germany?", False),
    ("How do I reverse a list in Python?", "How do I sort a list in Python?", False),
    ("How do I convert a string to an integer in Python?", "How do I convert an integer to a string in Python?", False),
    ("What does HTTP status 404 mean?", "What does HTTP status 500 mean?", False),
    ("How many days are in a leap year?", "How many days are in a regular year?", False),
    ("What is the boiling point of water?", "What is the freezing point of water?", False),
    ("How do I undo the last git commit?", "How do I amend the last git commit?", False),
    ("Who wrote Pride and Prejudice?", "Who wrote Sense and Sensibility?", False),
    ("How do I install numpy?", "How do I uninstall numpy?", False),
    ("What is 2 plus 2?", "What is 2 times 3?", False),
    ("How do I open a file in Python?", "How do I close a file in Python?", False),
]
