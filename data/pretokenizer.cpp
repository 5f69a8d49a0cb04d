#include "tessera/data/pretokenizer.h"

#include <algorithm>
#include <array>
#include <memory>

#include "tessera/data/unicode_tables.h"

namespace tessera::data {

namespace {

// Length of the well-formed UTF-8 sequence at bytes[i], or 0 when it is ill-formed.
// `subpart` receives the length of the maximal ill-formed subpart (>= 1) in that case:
// the lead byte and the continuation bytes that were still acceptable (Unicode 3.9, the
// rule Python's decoder follows for errors="replace").
size_t utf8_sequence(std::string_view bytes, size_t i, size_t& subpart) {
  const auto at = [&](size_t k) { return static_cast<unsigned char>(bytes[k]); };
  const unsigned char lead = at(i);
  if (lead < 0x80) return 1;
  size_t length = 0;
  unsigned char low = 0x80, high = 0xBF;  // allowed range of the second byte
  if (lead >= 0xC2 && lead <= 0xDF) {
    length = 2;
  } else if (lead >= 0xE0 && lead <= 0xEF) {
    length = 3;
    if (lead == 0xE0) low = 0xA0;   // overlong
    if (lead == 0xED) high = 0x9F;  // surrogates
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    length = 4;
    if (lead == 0xF0) low = 0x90;   // overlong
    if (lead == 0xF4) high = 0x8F;  // above U+10FFFF
  } else {
    subpart = 1;
    return 0;
  }
  for (size_t k = 1; k < length; ++k) {
    const bool ok = i + k < bytes.size() && (k == 1 ? at(i + k) >= low && at(i + k) <= high
                                                    : at(i + k) >= 0x80 && at(i + k) <= 0xBF);
    if (!ok) {
      subpart = k;
      return 0;
    }
  }
  return length;
}

// One class per code point (1.1 MB, built once from the generated range tables): a
// lookup is one load, which keeps the pre-tokenizer fast on non-Latin text.
const std::vector<CharClass>& class_table() {
  static const std::vector<CharClass> table = [] {
    std::vector<CharClass> t(0x110000, CharClass::Other);
    const auto fill = [&](const unicode::CodePointRange* ranges, size_t count, CharClass c) {
      for (size_t r = 0; r < count; ++r)
        std::fill(t.begin() + ranges[r].first, t.begin() + ranges[r].last + 1, c);
    };
    fill(unicode::kLetterRanges, unicode::kLetterRangeCount, CharClass::Letter);
    fill(unicode::kNumberRanges, unicode::kNumberRangeCount, CharClass::Number);
    fill(unicode::kWhiteSpaceRanges, unicode::kWhiteSpaceRangeCount, CharClass::Space);
    return t;
  }();
  return table;
}

}  // namespace

char32_t decode_utf8_at(std::string_view text, size_t i, size_t& length) {
  const auto at = [&](size_t k) {
    return static_cast<char32_t>(static_cast<unsigned char>(text[k]));
  };
  const char32_t lead = at(i);
  if (lead < 0x80) {
    length = 1;
    return lead;
  }
  if (lead < 0xE0) {
    length = 2;
    return ((lead & 0x1F) << 6) | (at(i + 1) & 0x3F);
  }
  if (lead < 0xF0) {
    length = 3;
    return ((lead & 0x0F) << 12) | ((at(i + 1) & 0x3F) << 6) | (at(i + 2) & 0x3F);
  }
  length = 4;
  return ((lead & 0x07) << 18) | ((at(i + 1) & 0x3F) << 12) | ((at(i + 2) & 0x3F) << 6) |
         (at(i + 3) & 0x3F);
}

void append_utf8(std::string& out, char32_t c) {
  if (c < 0x80) {
    out += static_cast<char>(c);
  } else if (c < 0x800) {
    out += static_cast<char>(0xC0 | (c >> 6));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else if (c < 0x10000) {
    out += static_cast<char>(0xE0 | (c >> 12));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (c >> 18));
    out += static_cast<char>(0x80 | ((c >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  }
}

size_t find_invalid_utf8(std::string_view bytes) {
  size_t i = 0, subpart = 0;
  while (i < bytes.size()) {
    if (static_cast<unsigned char>(bytes[i]) < 0x80) {
      ++i;
      continue;
    }
    const size_t length = utf8_sequence(bytes, i, subpart);
    if (length == 0) return i;
    i += length;
  }
  return std::string_view::npos;
}

std::string replace_invalid_utf8(std::string_view bytes) {
  size_t bad = find_invalid_utf8(bytes);
  if (bad == std::string_view::npos) return std::string(bytes);
  std::string out(bytes.substr(0, bad));
  out.reserve(bytes.size() + 16);
  size_t i = bad, subpart = 0;
  while (i < bytes.size()) {
    const size_t length = utf8_sequence(bytes, i, subpart);
    if (length == 0) {
      out += "\xEF\xBF\xBD";
      i += subpart;
    } else {
      out.append(bytes.substr(i, length));
      i += length;
    }
  }
  return out;
}

CharClass char_class(char32_t code_point) {
  return code_point < 0x110000 ? class_table()[code_point] : CharClass::Other;
}

bool GptPieces::next(std::string_view& piece) {
  const std::string_view t = text_;
  const size_t n = t.size(), start = pos_;
  if (start >= n) return false;
  static const CharClass* const classes = class_table().data();
  size_t length = 0;
  const auto class_at = [&](size_t i, size_t& len) { return classes[decode_utf8_at(t, i, len)]; };
  // The end of the run of characters of class `c` that starts at byte i.
  const auto run_end = [&](size_t i, CharClass c) {
    size_t len = 0;
    while (i < n && class_at(i, len) == c) i += len;
    return i;
  };
  size_t end = 0;
  const char first = t[start];
  if (first == '\'' && start + 1 < n) {  // contractions: 's 't 'm 'd 're 've 'll
    const char a = t[start + 1], b = start + 2 < n ? t[start + 2] : '\0';
    if (a == 's' || a == 't' || a == 'm' || a == 'd')
      end = start + 2;
    else if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l'))
      end = start + 3;
  }
  if (end == 0) {
    const CharClass c = class_at(start, length);
    if (c != CharClass::Space) {
      end = run_end(start, c);  // \p{L}+, \p{N}+ or [^\s\p{L}\p{N}]+
    } else if (first == ' ' && start + 1 < n && class_at(start + 1, length) != CharClass::Space) {
      end = run_end(start + 1, class_at(start + 1, length));  // one space joins the run after it
    } else {
      // \s+(?!\S): a whitespace run, leaving its last character to the next piece when a
      // non-space follows; a lone whitespace character before a non-space is \s+ alone.
      size_t last = start;  // start of the run's last character
      size_t i = start;
      while (i < n && class_at(i, length) == CharClass::Space) last = i, i += length;
      end = (i == n || last == start) ? i : last;
    }
  }
  piece = t.substr(start, end - start);
  pos_ = end;
  return true;
}

std::vector<std::string_view> gpt2_pieces(std::string_view valid_utf8) {
  std::vector<std::string_view> pieces;
  GptPieces splitter(valid_utf8);
  for (std::string_view p; splitter.next(p);) pieces.push_back(p);
  return pieces;
}

std::vector<size_t> safe_cut_points(std::string_view text, size_t parts) {
  std::vector<size_t> cuts;
  size_t previous = 0;
  for (size_t k = 1; k < parts; ++k) {
    size_t p = std::max(previous + 1, text.size() * k / parts);
    for (; p < text.size(); ++p) {
      const unsigned char c = static_cast<unsigned char>(text[p]);
      if (text[p - 1] == '\n' && c >= 0x21 && c <= 0x7E) break;
    }
    if (p >= text.size()) break;
    cuts.push_back(p);
    previous = p;
  }
  return cuts;
}

}  // namespace tessera::data
