#!/usr/bin/env python3
"""Writes data/bert_unicode_tables.cpp: the Unicode data BERT's normalizer and pre-tokenizer
need, as Hugging Face `tokenizers` 0.20.3 (what Debian's python3-tokenizers ships) uses it.

  control       removed by BertNormalizer's clean_text: general category Cc, Cf, Co except
                \\t \\n \\r (the `unicode_categories` crate's is_other(); NUL and U+FFFD are
                removed too, by the normalizer itself, see data/bert_normalizer.cpp)
  punctuation   split off by BertPreTokenizer: ASCII punctuation plus general category P*
  nonspacing    general category Mn, dropped after NFD by strip_accents
  decomposition full canonical decomposition (NFD) of every code point that has one, Hangul
                syllables excepted (they are decomposed arithmetically)
  combining     the non-zero canonical combining classes (NFD's canonical ordering)
  lowercase     the full lowercase mapping of each character (Rust's char::to_lowercase)
White space is Unicode's White_Space property, data/unicode_tables.cpp's kWhiteSpaceRanges.

The data come from the running Python's unicodedata (Python 3.11: Unicode 14.0.0). The
crates behind `tokenizers` 0.20.3 are older: `unicode_categories` 0.1.1 holds Unicode 8.0's
categories and `unicode-normalization-alignments` an older NFD, so characters assigned (or
re-categorised) since then are classified differently there. OLDER_UNICODE lists those
characters; `--overrides` prints that literal afresh by asking `tokenizers` about every
code point (a few calls per code point; seconds), so it can be checked
or regenerated. Rust's to_lowercase and White_Space agree with this Python's on every code
point (checked the same way), so they need no overrides.

Usage: python3 scripts/gen_bert_unicode_tables.py > data/bert_unicode_tables.cpp
       python3 scripts/gen_bert_unicode_tables.py --overrides   # needs `tokenizers`
"""
import os
import sys
import unicodedata

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gen_unicode_tables import emit, ranges  # noqa: E402

ASCII_PUNCTUATION = "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"

# What tokenizers 0.20.3 says where this Python's Unicode 14 data say otherwise, as
# inclusive code-point ranges (printed by --overrides).
OLDER_UNICODE = {
    "not_control": [(0x890, 0x891), (0x8E2, 0x8E2), (0x110CD, 0x110CD), (0x13430, 0x13438)],
    "control": [],
    "not_punctuation": [(0x61D, 0x61D), (0x9FD, 0x9FD), (0xA76, 0xA76), (0xC77, 0xC77),
        (0xC84, 0xC84), (0x1B7D, 0x1B7E), (0x2E43, 0x2E4F), (0x2E52, 0x2E5D), (0x10EAD, 0x10EAD),
        (0x10F55, 0x10F59), (0x10F86, 0x10F89), (0x1144B, 0x1144F), (0x1145A, 0x1145B),
        (0x1145D, 0x1145D), (0x11660, 0x1166C), (0x116B9, 0x116B9), (0x1183B, 0x1183B),
        (0x11944, 0x11946), (0x119E2, 0x119E2), (0x11A3F, 0x11A46), (0x11A9A, 0x11A9C),
        (0x11A9E, 0x11AA2), (0x11C41, 0x11C45), (0x11C70, 0x11C71), (0x11EF7, 0x11EF8),
        (0x11FFF, 0x11FFF), (0x12FF1, 0x12FF2), (0x16E97, 0x16E9A), (0x16FE2, 0x16FE2),
        (0x1E95E, 0x1E95F)],
    "punctuation": [(0x166D, 0x166D), (0x111C9, 0x111C9)],
    "not_nonspacing": [(0x7FD, 0x7FD), (0x898, 0x89F), (0x8CA, 0x8E1), (0x9FE, 0x9FE),
        (0xAFA, 0xAFF), (0xB55, 0xB55), (0xC04, 0xC04), (0xC3C, 0xC3C), (0xD00, 0xD00),
        (0xD3B, 0xD3C), (0xD81, 0xD81), (0xEBA, 0xEBA), (0x180F, 0x180F), (0x1885, 0x1886),
        (0x1ABF, 0x1ACE), (0x1DF6, 0x1DFB), (0xA82C, 0xA82C), (0xA8C5, 0xA8C5), (0xA8FF, 0xA8FF),
        (0xA9BD, 0xA9BD), (0x10D24, 0x10D27), (0x10EAB, 0x10EAC), (0x10F46, 0x10F50),
        (0x10F82, 0x10F85), (0x11070, 0x11070), (0x11073, 0x11074), (0x110C2, 0x110C2),
        (0x111C9, 0x111C9), (0x111CF, 0x111CF), (0x1123E, 0x1123E), (0x1133B, 0x1133B),
        (0x11438, 0x1143F), (0x11442, 0x11444), (0x11446, 0x11446), (0x1145E, 0x1145E),
        (0x1182F, 0x11837), (0x11839, 0x1183A), (0x1193B, 0x1193C), (0x1193E, 0x1193E),
        (0x11943, 0x11943), (0x119D4, 0x119D7), (0x119DA, 0x119DB), (0x119E0, 0x119E0),
        (0x11A01, 0x11A0A), (0x11A33, 0x11A38), (0x11A3B, 0x11A3E), (0x11A47, 0x11A47),
        (0x11A51, 0x11A56), (0x11A59, 0x11A5B), (0x11A8A, 0x11A96), (0x11A98, 0x11A99),
        (0x11C30, 0x11C36), (0x11C38, 0x11C3D), (0x11C3F, 0x11C3F), (0x11C92, 0x11CA7),
        (0x11CAA, 0x11CB0), (0x11CB2, 0x11CB3), (0x11CB5, 0x11CB6), (0x11D31, 0x11D36),
        (0x11D3A, 0x11D3A), (0x11D3C, 0x11D3D), (0x11D3F, 0x11D45), (0x11D47, 0x11D47),
        (0x11D90, 0x11D91), (0x11D95, 0x11D95), (0x11D97, 0x11D97), (0x11EF3, 0x11EF4),
        (0x16F4F, 0x16F4F), (0x16FE4, 0x16FE4), (0x1CF00, 0x1CF2D), (0x1CF30, 0x1CF46),
        (0x1E000, 0x1E006), (0x1E008, 0x1E018), (0x1E01B, 0x1E021), (0x1E023, 0x1E024),
        (0x1E026, 0x1E02A), (0x1E130, 0x1E136), (0x1E2AE, 0x1E2AE), (0x1E2EC, 0x1E2EF),
        (0x1E944, 0x1E94A)],
    "nonspacing": [(0x1734, 0x1734)],
    "no_decomposition": [(0x11938, 0x11938)],
    "no_combining_class": [(0x7FD, 0x7FD), (0x898, 0x89F), (0x8CA, 0x8D3), (0x9FE, 0x9FE),
        (0xC3C, 0xC3C), (0xD3B, 0xD3C), (0xEBA, 0xEBA), (0x1715, 0x1715), (0x1ABF, 0x1ACE),
        (0x1DF6, 0x1DFA), (0xA82C, 0xA82C), (0x10D24, 0x10D27), (0x10EAB, 0x10EAC),
        (0x10F46, 0x10F50), (0x10F82, 0x10F85), (0x11070, 0x11070), (0x1133B, 0x1133B),
        (0x1145E, 0x1145E), (0x11839, 0x1183A), (0x1193D, 0x1193E), (0x11943, 0x11943),
        (0x119E0, 0x119E0), (0x11A34, 0x11A34), (0x11A47, 0x11A47), (0x11A99, 0x11A99),
        (0x11D42, 0x11D42), (0x11D44, 0x11D45), (0x11D97, 0x11D97), (0x16FF0, 0x16FF1),
        (0x1E130, 0x1E136), (0x1E2AE, 0x1E2AE), (0x1E2EC, 0x1E2EF)],
}


def category(c):
    return unicodedata.category(chr(c))


def in_ranges(c, rs):
    return any(lo <= c <= hi for lo, hi in rs)


def with_overrides(predicate, yes, no):
    return lambda c: (predicate(c) or in_ranges(c, OLDER_UNICODE[yes])) and not in_ranges(
        c, OLDER_UNICODE[no])


def is_control(c):
    return chr(c) not in "\t\n\r" and category(c) in ("Cc", "Cf", "Co")


def is_punctuation(c):
    return chr(c) in ASCII_PUNCTUATION or category(c).startswith("P")


def is_nonspacing(c):
    return category(c) == "Mn"


def decomposition(c):
    if 0xAC00 <= c <= 0xD7A3 or in_ranges(c, OLDER_UNICODE["no_decomposition"]):
        return None
    d = unicodedata.normalize("NFD", chr(c))
    return d if d != chr(c) else None


def combining_class(c):
    return 0 if in_ranges(c, OLDER_UNICODE["no_combining_class"]) else unicodedata.combining(chr(c))


def code_points():
    return (c for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF)


def emit_mappings(name, mapping):
    """{code point: str} as kName[] = {{cp, offset, length}} into a shared kNamePool."""
    pool, rows = [], []
    for c, text in sorted(mapping.items()):
        rows.append(f"{{0x{c:X}, {len(pool)}, {len(text)}}}")
        pool.extend(ord(x) for x in text)
    lines = [f"const CodePointMapping {name}[] = {{"]
    for i in range(0, len(rows), 5):
        lines.append("    " + ", ".join(rows[i:i + 5]) + ",")
    lines.append("};")
    lines.append(f"const size_t {name}Count = {len(rows)};")
    lines.append(f"const char32_t {name}Pool[] = {{")
    for i in range(0, len(pool), 10):
        lines.append("    " + ", ".join(f"0x{x:X}" for x in pool[i:i + 10]) + ",")
    lines.append("};")
    return "\n".join(lines)


def emit_classes(classes):
    lines = ["const CombiningClass kCombiningClasses[] = {"]
    rows = [f"{{0x{c:X}, {k}}}" for c, k in sorted(classes.items())]
    for i in range(0, len(rows), 8):
        lines.append("    " + ", ".join(rows[i:i + 8]) + ",")
    lines.append("};")
    lines.append(f"const size_t kCombiningClassCount = {len(rows)};")
    return "\n".join(lines)


def generate():
    control = ranges(with_overrides(is_control, "control", "not_control"))
    punctuation = ranges(with_overrides(is_punctuation, "punctuation", "not_punctuation"))
    nonspacing = ranges(with_overrides(is_nonspacing, "nonspacing", "not_nonspacing"))
    decompositions, lowercase, classes = {}, {}, {}
    for c in code_points():
        d = decomposition(c)
        if d is not None:
            decompositions[c] = d
        if chr(c).lower() != chr(c):
            lowercase[c] = chr(c).lower()
        if combining_class(c):
            classes[c] = combining_class(c)
    print(f"""// Generated by scripts/gen_bert_unicode_tables.py from Python {sys.version.split()[0]}'s
// unicodedata (Unicode {unicodedata.unidata_version}) with the script's OLDER_UNICODE overrides (what
// Hugging Face tokenizers 0.20.3's older crates say); do not edit by hand, rerun the script.
// clang-format off
#include "tessera/data/bert_unicode_tables.h"

namespace tessera::data::unicode {{

const char kBertUnicodeVersion[] = "{unicodedata.unidata_version}";

{emit("kBertControlRanges", control)}
const size_t kBertControlRangeCount = {len(control)};

{emit("kBertPunctuationRanges", punctuation)}
const size_t kBertPunctuationRangeCount = {len(punctuation)};

{emit("kNonspacingMarkRanges", nonspacing)}
const size_t kNonspacingMarkRangeCount = {len(nonspacing)};

{emit_mappings("kCanonicalDecompositions", decompositions)}

{emit_classes(classes)}

{emit_mappings("kLowercaseMappings", lowercase)}

}}  // namespace tessera::data::unicode""")


def as_ranges(cps):
    out = []
    for c in sorted(cps):
        if out and out[-1][1] == c - 1:
            out[-1][1] = c
        else:
            out.append([c, c])
    return [(lo, hi) for lo, hi in out]


def print_overrides():
    """Asks tokenizers about every code point; prints what OLDER_UNICODE should hold."""
    from tokenizers import normalizers, pre_tokenizers

    def bert(**switches):
        off = dict(clean_text=False, handle_chinese_chars=False, strip_accents=False,
                   lowercase=False)
        off.update(switches)
        return normalizers.BertNormalizer(**off)

    clean, strip, nfd = bert(clean_text=True), bert(strip_accents=True), normalizers.NFD()
    pre = pre_tokenizers.BertPreTokenizer()
    found = {key: [] for key in OLDER_UNICODE}

    def record(theirs, ours, yes, no, c):
        if theirs and not ours:
            found[yes].append(c)
        elif ours and not theirs:
            found[no].append(c)

    for c in code_points():
        ch = chr(c)
        if c not in (0, 0xFFFD):  # removed by the normalizer whatever their category
            record(clean.normalize_str(ch) == "", is_control(c), "control", "not_control", c)
        words = [w for w, _ in pre.pre_tokenize_str("a" + ch + "a")]
        record(words == ["a", ch, "a"], is_punctuation(c), "punctuation", "not_punctuation", c)
        their_nfd = nfd.normalize_str(ch)
        if their_nfd == ch and unicodedata.normalize("NFD", ch) != ch and not 0xAC00 <= c <= 0xD7A3:
            found["no_decomposition"].append(c)
        if their_nfd == ch:
            record(strip.normalize_str(ch) == "", is_nonspacing(c), "nonspacing", "not_nonspacing", c)
        # A mark of class k > 1 before U+0334 (class 1) moves behind it, unless classless.
        if unicodedata.combining(ch) > 1 and nfd.normalize_str("a" + ch + "\u0334") == "a" + ch + "\u0334":
            found["no_combining_class"].append(c)
    print("OLDER_UNICODE = {")
    for key, cps in found.items():
        print(f'    "{key}": [' + ", ".join(f"(0x{lo:X}, 0x{hi:X})" for lo, hi in as_ranges(cps)) + "],")
    print("}")


if __name__ == "__main__":
    if sys.argv[1:] == ["--overrides"]:
        print_overrides()
    else:
        generate()
