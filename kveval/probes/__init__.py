"""Long-context recall probes and the memory-confusion taxonomy.

Families (see :data:`FAMILIES`): ``passkey``, ``niah_single``, ``niah_multikey``,
``niah_multivalue``, ``niah_multiquery``, ``kv_retrieval``, ``variable_tracking``,
``update_stream``, ``multi_turn`` and ``system_rules`` (:mod:`kveval.probes.shared_prompt`). Items are generated offline and
deterministically (seeded ``random.Random``) to an exact token length of the
model's tokenizer; :func:`encode_item` turns one into context and question ids;
:func:`score_answer` scores an answer and names its failure category.

Example
-------
>>> from kveval.modeling.sources import load_tokenizer
>>> from kveval.probes import generate_items, encode_item, score_answer
>>> tokenizer = load_tokenizer("smollm2-135m")                                 # doctest: +SKIP
>>> items = generate_items("niah_multikey", tokenizer, length=512, n=5)        # doctest: +SKIP
>>> context_ids, question_ids = encode_item(tokenizer, items[0])               # doctest: +SKIP
>>> score_answer(items[0], " 8412337.").category                               # doctest: +SKIP
'correct'
"""

from kveval.probes.families import (
    DEFAULT_DEPTHS,
    FAMILIES,
    Cell,
    Family,
    generate_grid,
    generate_items,
    grid,
    resolve_families,
)
from kveval.probes.item import ROLES, Needle, ProbeItem, encode_item
from kveval.probes.scoring import CATEGORIES, Score, category_metrics, extract_values, score_answer

__all__ = [
    "CATEGORIES", "DEFAULT_DEPTHS", "FAMILIES", "ROLES", "Cell", "Family", "Needle", "ProbeItem", "Score",
    "category_metrics", "encode_item", "extract_values", "generate_grid", "generate_items", "grid",
    "resolve_families", "score_answer",
]
