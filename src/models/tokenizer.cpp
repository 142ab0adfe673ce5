// remat::models::Tokenizer (see include/remat/models/tokenizer.h): the
// character-level mapping and SentencePiece BPE (Debian libsentencepiece-dev:
// training, encoding, decoding). Leaves out: SentencePiece's protobuf headers
// (Debian ships none; the model type is read off the serialized model).
#include <remat/models/tokenizer.h>

#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <system_error>
#include <thread>
#include <unordered_map>

#include <unistd.h>

#include <remat/error.h>

namespace remat::models {

namespace {

std::string str(int64_t v) { return std::to_string(v); }

std::string read_file(const std::string& path, const char* what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    throw Error("[remat::tokenizer] cannot read " + std::string(what) + " '" + path +
                "': " + std::error_code(errno, std::generic_category()).message() + ".");
  }
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

/** The lines of a text that train a SentencePiece model: the non-empty
 *  lines, at most max_lines of them, taken evenly over the text. */
class LineSample : public sentencepiece::SentenceIterator {
 public:
  LineSample(std::string_view text, int64_t max_lines) {
    std::vector<std::string_view> all;
    size_t pos = 0;
    while (pos < text.size()) {
      size_t end = text.find('\n', pos);
      if (end == std::string_view::npos) end = text.size();
      if (end > pos) all.push_back(text.substr(pos, end - pos));
      pos = end + 1;
    }
    const auto n = static_cast<int64_t>(all.size());
    if (n <= max_lines) {
      lines_ = std::move(all);
    } else {
      lines_.reserve(static_cast<size_t>(max_lines));
      for (int64_t i = 0; i < max_lines; ++i) lines_.push_back(all[static_cast<size_t>(i * n / max_lines)]);
    }
    if (!lines_.empty()) current_.assign(lines_[0]);
  }
  bool done() const override { return next_ >= lines_.size(); }
  void Next() override {
    if (++next_ < lines_.size()) current_.assign(lines_[next_]);
  }
  const std::string& value() const override { return current_; }
  sentencepiece::util::Status status() const override { return {}; }
  size_t size() const { return lines_.size(); }

 private:
  std::vector<std::string_view> lines_;
  size_t next_ = 0;
  std::string current_;
};

/** Reads a protobuf varint at data[pos], advancing pos; false at a malformed end. */
bool read_varint(std::string_view data, size_t& pos, uint64_t& v) {
  v = 0;
  for (int shift = 0; shift < 64 && pos < data.size(); shift += 7) {
    const auto b = static_cast<unsigned char>(data[pos++]);
    v |= static_cast<uint64_t>(b & 0x7f) << shift;
    if (!(b & 0x80)) return true;
  }
  return false;
}

/** Field `field` of a serialized protobuf message: a varint (wire type 0)
 *  into *varint, or a length-delimited value (wire type 2) into *bytes.
 *  False when absent or malformed. */
bool find_field(std::string_view msg, uint64_t field, uint64_t* varint, std::string_view* bytes) {
  size_t pos = 0;
  while (pos < msg.size()) {
    uint64_t key = 0, v = 0;
    if (!read_varint(msg, pos, key)) return false;
    const uint64_t wire = key & 7;
    if (wire == 0) {
      if (!read_varint(msg, pos, v)) return false;
      if ((key >> 3) == field && varint) {
        *varint = v;
        return true;
      }
    } else if (wire == 2) {
      if (!read_varint(msg, pos, v) || v > msg.size() - pos) return false;
      if ((key >> 3) == field && bytes) {
        *bytes = msg.substr(pos, v);
        return true;
      }
      pos += v;
    } else if (wire == 1) {
      pos += 8;
    } else if (wire == 5) {
      pos += 4;
    } else {
      return false;
    }
  }
  return false;
}

/** "unigram", "bpe", "word" or "char": ModelProto.trainer_spec (field 2)
 *  .model_type (field 3; absent means unigram, the proto's default). */
std::string model_type(std::string_view model) {
  std::string_view spec;
  uint64_t type = 1;
  if (find_field(model, 2, nullptr, &spec)) find_field(spec, 3, &type, nullptr);
  switch (type) {
    case 2: return "bpe";
    case 3: return "word";
    case 4: return "char";
    default: return "unigram";
  }
}

/** The number after `marker` in text, or -1. */
int64_t number_after(const std::string& text, const std::string& marker) {
  const auto at = text.find(marker);
  if (at == std::string::npos) return -1;
  try {
    return std::stoll(text.substr(at + marker.size()));
  } catch (const std::exception&) {
    return -1;
  }
}

/** Texts longer than this encode in pieces cut after a newline (the same
 *  ids when no piece holds a newline; SentencePiece's BPE encodes an 11 MB
 *  text in 12 s whole and in 3.5 s in 64 KiB pieces). */
constexpr size_t kEncodeChunkBytes = 64 * 1024;

}  // namespace

struct Tokenizer::Impl {
  bool chars = true;
  std::array<int64_t, 256> id{};     // characters: byte -> id, -1 when absent
  std::vector<unsigned char> bytes;  // characters: id -> byte
  sentencepiece::SentencePieceProcessor sp;
  std::string path;  // sentencepiece: the .model file ("" when in memory)
  std::string type;  // sentencepiece: "bpe", "unigram", ...
  bool chunk_at_newlines = false;
  std::string hash;  // sentencepiece: 16 hex digits over the pieces

  int64_t vocab() const { return chars ? static_cast<int64_t>(bytes.size()) : sp.GetPieceSize(); }

  /** After sp is loaded: type, hash and whether encode may cut at newlines. */
  void describe_model() {
    type = model_type(sp.serialized_model_proto());
    uint64_t h = 1469598103934665603ULL;  // FNV-1a 64
    chunk_at_newlines = true;
    for (int i = 0; i < sp.GetPieceSize(); ++i) {
      const std::string& piece = sp.IdToPiece(i);
      if (piece.find('\n') != std::string::npos) chunk_at_newlines = false;
      for (unsigned char ch : piece) h = (h ^ ch) * 1099511628211ULL;
      h = (h ^ 0xffu) * 1099511628211ULL;  // separator (0xff is never in UTF-8 text)
    }
    char buf[17];
    std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
    hash = buf;
  }
};

Tokenizer::Tokenizer(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}

Tokenizer Tokenizer::characters(const std::string& text) {
  auto m = std::make_shared<Impl>();
  m->id.fill(-1);
  for (unsigned char ch : text) m->id[ch] = 0;
  for (int b = 0; b < 256; ++b) {
    if (m->id[b] == 0) {
      m->id[b] = static_cast<int64_t>(m->bytes.size());
      m->bytes.push_back(static_cast<unsigned char>(b));
    }
  }
  return Tokenizer(std::move(m));
}

Tokenizer Tokenizer::train_sentencepiece(const std::string& text_path, int64_t vocab_size,
                                         const std::string& model_path) {
  if (vocab_size <= 0) {
    throw Error("[remat::tokenizer] vocab_size must be positive to train a SentencePiece model, got " +
                str(vocab_size) + ". Pass e.g. 8000 (--vocab-size 8000).");
  }
  const std::string text = read_file(text_path, "text file");
  LineSample sample(text, kSentencePieceMaxSentences);
  if (sample.size() == 0) {
    throw Error("[remat::tokenizer] text file '" + text_path +
                "' has no non-empty line to train a SentencePiece model on. Pass a longer text.");
  }
  const unsigned threads = std::clamp(std::thread::hardware_concurrency(), 1u, 16u);
  // NOTE [SentencePiece options]: BPE (GPT-2's kind of vocabulary; trains
  // about 4x faster than unigram here: 8 s against 30 s for 8000 pieces on
  // an 11 MB corpus). identity normalisation, no dummy prefix and no
  // whitespace folding keep the text as is; byte_fallback maps characters
  // outside the vocabulary, and newlines (lines are the sentences, so no
  // piece holds one), to byte pieces, so decode(encode(s)) == s;
  // whitespace-only pieces let indentation be one token. No BOS/EOS: the
  // trainer reads one stream of tokens.
  const std::unordered_map<std::string, std::string> args = {
      {"model_type", "bpe"},
      {"vocab_size", str(vocab_size)},
      {"normalization_rule_name", "identity"},
      {"add_dummy_prefix", "false"},
      {"remove_extra_whitespaces", "false"},
      {"allow_whitespace_only_pieces", "true"},
      {"byte_fallback", "true"},
      {"bos_id", "-1"},
      {"eos_id", "-1"},
      {"input_sentence_size", "0"},  // the sample is already capped (LineSample)
      {"num_threads", str(threads)},
      {"minloglevel", "2"},  // SentencePiece's progress logs off; errors come back as a status
      {"model_prefix", ""},
  };
  std::string model;
  const auto status = sentencepiece::SentencePieceTrainer::Train(args, &sample, &model);
  if (!status.ok()) {
    const std::string msg = status.error_message();
    const std::string what =
        "[remat::tokenizer] cannot train a SentencePiece model of vocab_size " + str(vocab_size) + " on '" + text_path;
    if (const int64_t most = number_after(msg, "set it to a value <= "); most > 0) {
      throw Error(what + "': the text has pieces for at most " + str(most) +
                  ". Use a vocab_size (--vocab-size) of at most " + str(most) + ", or a longer text.");
    }
    if (const int64_t least = number_after(msg, "required_chars. " + str(vocab_size) + " vs "); least > 0) {
      throw Error(what + "': its characters, special and byte pieces need " + str(least) +
                  ". Use a vocab_size (--vocab-size) of at least " + str(least) + ".");
    }
    throw Error(what + "': SentencePiece says: " + msg + ".");
  }
  if (!model_path.empty()) {
    const std::filesystem::path target(model_path);
    auto tmp = target;
    tmp += ".tmp." + std::to_string(::getpid());
    bool ok = false;
    {
      std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
      ok = static_cast<bool>(out.write(model.data(), static_cast<std::streamsize>(model.size())).flush());
    }
    std::error_code ec;
    if (ok) std::filesystem::rename(tmp, target, ec);
    if (!ok || ec) {
      const std::string why = ec ? ec.message() : std::error_code(errno, std::generic_category()).message();
      std::filesystem::remove(tmp, ec);
      throw Error("[remat::tokenizer] cannot write the SentencePiece model to '" + model_path + "': " + why +
                  ". Check that the folder exists and is writable.");
    }
  }
  auto m = std::make_shared<Impl>();
  m->chars = false;
  m->path = model_path;
  if (const auto s = m->sp.LoadFromSerializedProto(model); !s.ok()) {
    throw Error("[remat::tokenizer] internal: SentencePiece cannot load the model it trained (" + s.ToString() +
                "). Please report this bug.");
  }
  m->describe_model();
  return Tokenizer(std::move(m));
}

Tokenizer Tokenizer::load(const std::string& model_path) {
  std::error_code ec;
  if (!std::filesystem::exists(model_path, ec)) {
    throw Error("[remat::tokenizer] SentencePiece model '" + model_path +
                "' does not exist. Train one with Tokenizer::train_sentencepiece (remat-train --vocab-size N "
                "--tokenizer " +
                model_path + ").");
  }
  const std::string model = read_file(model_path, "SentencePiece model");
  auto m = std::make_shared<Impl>();
  m->chars = false;
  m->path = model_path;
  if (const auto s = m->sp.LoadFromSerializedProto(model); !s.ok()) {
    throw Error("[remat::tokenizer] '" + model_path + "' is not a SentencePiece model (" + s.error_message() +
                "). Pass a .model file written by train_sentencepiece (remat-train --vocab-size N --tokenizer PATH).");
  }
  m->describe_model();
  return Tokenizer(std::move(m));
}

std::vector<int64_t> Tokenizer::encode(std::string_view text,
                                       const std::function<void(int64_t done_bytes)>& progress) const {
  const Impl& m = *impl_;
  std::vector<int64_t> out;
  if (m.chars) {
    out.resize(text.size());
    for (size_t i = 0; i < text.size(); ++i) {
      const auto ch = static_cast<unsigned char>(text[i]);
      if (m.id[ch] < 0) {
        char hex[8];
        std::snprintf(hex, sizeof hex, "0x%02x", ch);
        throw Error("[remat::tokenizer] byte " + std::string(hex) + " at offset " + str(static_cast<int64_t>(i)) +
                    " is not in the character vocabulary (" + str(m.vocab()) +
                    " bytes). Build the vocabulary from a text that has it (Tokenizer::characters).");
      }
      out[i] = m.id[ch];
    }
    if (progress) progress(static_cast<int64_t>(text.size()));
    return out;
  }
  std::vector<int> part;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.size();
    if (m.chunk_at_newlines && text.size() - pos > kEncodeChunkBytes) {
      const size_t nl = text.find('\n', pos + kEncodeChunkBytes);
      if (nl != std::string_view::npos) end = nl + 1;
    }
    if (const auto s = m.sp.Encode(text.substr(pos, end - pos), &part); !s.ok()) {
      throw Error("[remat::tokenizer] internal: SentencePiece cannot encode (" + s.ToString() +
                  "). Please report this bug.");
    }
    out.insert(out.end(), part.begin(), part.end());
    pos = end;
    if (progress) progress(static_cast<int64_t>(pos));
  }
  return out;
}

std::string Tokenizer::decode(const std::vector<int64_t>& ids) const {
  const Impl& m = *impl_;
  const int64_t n = m.vocab();
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= n) {
      throw Error("[remat::tokenizer] id " + str(ids[i]) + " at position " + str(static_cast<int64_t>(i)) +
                  " is outside the vocabulary [0, " + str(n) + "). Decode ids that this tokenizer encoded.");
    }
  }
  if (m.chars) {
    std::string out(ids.size(), '\0');
    for (size_t i = 0; i < ids.size(); ++i) out[i] = static_cast<char>(m.bytes[static_cast<size_t>(ids[i])]);
    return out;
  }
  const std::vector<int> narrow(ids.begin(), ids.end());
  std::string out;
  if (const auto s = m.sp.Decode(narrow, &out); !s.ok()) {
    throw Error("[remat::tokenizer] internal: SentencePiece cannot decode (" + s.ToString() +
                "). Please report this bug.");
  }
  return out;
}

int64_t Tokenizer::vocab_size() const { return impl_->vocab(); }

bool Tokenizer::is_characters() const { return impl_->chars; }

std::string Tokenizer::describe() const {
  const Impl& m = *impl_;
  if (m.chars) return "characters (" + str(m.vocab()) + ")";
  return "sentencepiece " + m.type + " " + str(m.vocab()) + " (" + (m.path.empty() ? "in memory" : m.path) + ")";
}

std::string Tokenizer::fingerprint() const {
  const Impl& m = *impl_;
  if (m.chars) return "characters " + str(m.vocab());
  return "sentencepiece " + m.type + " " + str(m.vocab()) + " #" + m.hash;
}

}  // namespace remat::models
