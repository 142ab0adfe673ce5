// Text to token ids and back for the GPT trainer: character level (one id
// per distinct byte of a text) or SentencePiece subwords (BPE; trained on a
// text file, saved as a .model file, loaded back). Lossless: decode(encode(s))
// == s for any text whose bytes the tokenizer covers (every byte, for
// SentencePiece: unseen characters fall back to byte pieces).
// Leaves out: special tokens (BOS/EOS/padding), sampling (subword
// regularisation), the unigram model, normalisation (text is kept as is).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace remat::models {

/** Token ids of a text and back: see characters(), train_sentencepiece()
 *  and load(). Copies share the (immutable) model. Throws remat::Error. */
class Tokenizer {
 public:
  /** Character level: one id per distinct byte of text, in order of byte
   *  value (the smallest byte present is id 0); vocab_size() is the number
   *  of distinct bytes. encode() refuses bytes not in text. */
  static Tokenizer characters(const std::string& text);

  /** Trains a SentencePiece BPE model of vocab_size pieces on the text
   *  file text_path and, when model_path is not empty, writes it there
   *  (model_path.tmp.PID, then renamed over model_path); with an empty
   *  model_path the model stays in memory. Training sees each line of the
   *  file as a sentence, at most kSentencePieceMaxSentences of them (taken
   *  evenly over the file, deterministically); the pieces keep the text as
   *  is (no normalisation, spaces and indentation kept) and fall back to
   *  one piece per byte for characters outside the vocabulary (256 of the
   *  pieces), so vocab_size must be at least about 260 plus the text's
   *  distinct characters. Throws remat::Error for vocab_size <= 0, an
   *  unreadable file, or a vocab_size the text cannot fill (naming the
   *  largest it can). Same file and size: the same model. */
  static Tokenizer train_sentencepiece(const std::string& text_path, int64_t vocab_size, const std::string& model_path);

  /** Loads a SentencePiece .model file (as train_sentencepiece() writes).
   *  Throws remat::Error naming the path when it is missing or not a model. */
  static Tokenizer load(const std::string& model_path);

  /** Token ids of text, each in [0, vocab_size()). Character level: throws
   *  remat::Error for a byte that is not in the vocabulary. A long text
   *  encodes in pieces (SentencePiece: 64 KiB, cut after a newline); after
   *  each, progress (when given) gets the bytes of text encoded so far. */
  std::vector<int64_t> encode(std::string_view text,
                              const std::function<void(int64_t done_bytes)>& progress = {}) const;
  /** The text of ids (the inverse of encode()). Throws remat::Error for an
   *  id outside [0, vocab_size()). */
  std::string decode(const std::vector<int64_t>& ids) const;
  /** Number of distinct ids. */
  int64_t vocab_size() const;
  /** True for the character level (characters()), false for SentencePiece. */
  bool is_characters() const;
  /** "characters (76)", "sentencepiece bpe 8000 (PATH)", or
   *  "sentencepiece bpe 8000 (in memory)" for a model that was not saved. */
  std::string describe() const;
  /** Identifies the vocabulary: "characters 76" or "sentencepiece bpe 8000
   *  #<16 hex digits>", a hash of every piece in id order, so two
   *  tokenizers with equal fingerprints give the same ids (the trainer's
   *  checkpoints record it). */
  std::string fingerprint() const;

  /** At most this many lines of the text train a SentencePiece model
   *  (32000 pieces on 2 cores: 13 s on 301,047 lines, 11 MB; 18 s on twice
   *  that; docs/training.md). */
  static constexpr int64_t kSentencePieceMaxSentences = 1000000;

 private:
  struct Impl;
  explicit Tokenizer(std::shared_ptr<const Impl> impl);
  std::shared_ptr<const Impl> impl_;
};

}  // namespace remat::models
