// GPT-2's pre-tokenizer, written out by hand: the text is cut into pieces by the pattern
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// (first alternative that matches wins, as in Python's `regex`, tiktoken and Hugging Face
// `tokenizers`), and BPE merges never cross a piece. Byte-level BPE tokenizers (GPT-2's,
// Hugging Face ByteLevel ones and Tessera's own) all cut text this way.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace tessera::data {

// What tiktoken and Hugging Face see when a user decodes bytes with Python's
// bytes.decode("utf-8", errors="replace"): every maximal ill-formed subsequence (an
// invalid byte, a truncated sequence, an encoded surrogate or overlong form) becomes one
// U+FFFD (EF BF BD). Valid UTF-8 comes back unchanged.
std::string replace_invalid_utf8(std::string_view bytes);
// Byte offset of the first ill-formed sequence, or npos when `bytes` is valid UTF-8.
size_t find_invalid_utf8(std::string_view bytes);

// The code point at byte i of valid UTF-8; `length` receives its byte count.
char32_t decode_utf8_at(std::string_view valid_utf8, size_t i, size_t& length);
// Appends the UTF-8 of a code point (below 0x110000).
void append_utf8(std::string& out, char32_t code_point);

enum class CharClass : uint8_t { Letter, Number, Space, Other };
// \p{L}, \p{N}, \s (White_Space) or none of them.
CharClass char_class(char32_t code_point);

// Cuts valid UTF-8 into GPT-2 pieces, one at a time:
//   GptPieces pieces(text); for (std::string_view p; pieces.next(p);) ...
class GptPieces {
 public:
  explicit GptPieces(std::string_view valid_utf8) : text_(valid_utf8) {}
  bool next(std::string_view& piece);

 private:
  std::string_view text_;
  size_t pos_ = 0;
};

std::vector<std::string_view> gpt2_pieces(std::string_view valid_utf8);

// Offsets where text may be cut without changing its pieces: after a '\n' that is
// followed by printable ASCII (no piece runs across such a point, and the regex
// has no look-behind). Returns up to `parts - 1` cut points near equal spacing.
std::vector<size_t> safe_cut_points(std::string_view text, size_t parts);

}  // namespace tessera::data
