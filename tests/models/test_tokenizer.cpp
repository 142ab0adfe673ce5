// remat::models::Tokenizer and the trainer's tokenizer options: the
// character level against the trainer's original mapping, SentencePiece
// training on a small corpus (round trip, load gives the same ids), a GPT
// trained with --vocab-size, resume across vocabularies, max_under's data
// limit in tokens, and the errors (texts pinned). Every file goes to a
// temporary folder that must hold only the expected files at the end.
// Leaves out: training times at 8k-50k pieces (docs/training.md measures them).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <remat/error.h>
#include <remat/models/gpt.h>
#include <remat/models/tokenizer.h>
#include <remat/models/trainer.h>

namespace rm = remat::models;
namespace fs = std::filesystem;

namespace {

/** The trainer's character-level mapping before Tokenizer existed
 *  (Trainer::Impl::load_text): ids by byte value of the distinct bytes. */
std::vector<int64_t> reference_char_ids(const std::string& text, int64_t* vocab) {
  std::array<int64_t, 256> id;
  id.fill(-1);
  for (unsigned char ch : text) id[ch] = 0;
  *vocab = 0;
  for (auto& v : id) {
    if (v == 0) v = (*vocab)++;
  }
  std::vector<int64_t> ids(text.size());
  for (size_t i = 0; i < text.size(); ++i) ids[i] = id[static_cast<unsigned char>(text[i])];
  return ids;
}

/** About 6 KB of lowercase words, spaces, periods and newlines (25
 *  distinct bytes), the same every run. */
std::string small_corpus() {
  const std::vector<std::string> words = {
      "the",    "gradient", "checkpoint", "memory", "layer", "tensor", "saved", "recompute", "forward", "backward",
      "budget", "planner",  "block",      "of",     "and",   "a",      "is",    "in",        "with",    "schedule"};
  std::string text;
  uint64_t state = 12345;
  for (int line = 0; line < 120; ++line) {
    const int n = 4 + line % 7;
    for (int w = 0; w < n; ++w) {
      state = state * 6364136223846793005ULL + 1442695040888963407ULL;
      text += words[(state >> 33) % words.size()];
      text += w + 1 < n ? " " : ".";
    }
    text += "\n";
  }
  return text;
}

/** A fresh folder under the system's temporary directory, removed at the end. */
class TokenizerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("remat-test-tokenizer-" + std::to_string(::getpid()) + "-" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    corpus_ = (dir_ / "corpus.txt").string();
    std::ofstream(corpus_, std::ios::binary) << small_corpus();
  }
  void TearDown() override { fs::remove_all(dir_); }
  /** The names of the files in the folder now. */
  std::set<std::string> files() const {
    std::set<std::string> out;
    for (const auto& e : fs::directory_iterator(dir_)) out.insert(e.path().filename().string());
    return out;
  }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  /** A GPT small enough to train a step in milliseconds, on the corpus. */
  rm::TrainConfig tiny_gpt() const {
    rm::TrainConfig c;
    c.layers = 1;
    c.d_model = 16;
    c.heads = 2;
    c.seq_len = 16;
    c.batch = 2;
    c.steps = 2;
    c.threads = 1;
    c.data_path = corpus_;
    return c;
  }

  fs::path dir_;
  std::string corpus_;
};

/** The message of the remat::Error that f throws ("" when none). */
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const remat::Error& e) {
    return e.what();
  }
  return "";
}

constexpr int64_t kVocab = 320;  // 256 byte pieces, <unk>, 24 characters, and merges

}  // namespace

TEST_F(TokenizerTest, CharactersEqualTheTrainersOriginalMapping) {
  std::string text = small_corpus();
  text += "Zz\t\x01\xff!";  // bytes below, between and above the corpus's
  int64_t vocab = 0;
  const auto expected = reference_char_ids(text, &vocab);
  const auto tok = rm::Tokenizer::characters(text);
  EXPECT_EQ(tok.encode(text), expected);
  EXPECT_EQ(tok.vocab_size(), vocab);
  EXPECT_EQ(tok.decode(expected), text);
  EXPECT_TRUE(tok.is_characters());
  EXPECT_EQ(tok.describe(), "characters (" + std::to_string(vocab) + ")");
  EXPECT_EQ(error_of([&] { tok.encode("#"); }),
            "[remat::tokenizer] byte 0x23 at offset 0 is not in the character vocabulary (" + std::to_string(vocab) +
                " bytes). Build the vocabulary from a text that has it (Tokenizer::characters).");
  EXPECT_EQ(error_of([&] { tok.decode({vocab}); }),
            "[remat::tokenizer] id " + std::to_string(vocab) + " at position 0 is outside the vocabulary [0, " +
                std::to_string(vocab) + "). Decode ids that this tokenizer encoded.");

  // The trainer's default (no tokenizer) gives the same vocabulary and summary as before.
  rm::Trainer trainer(tiny_gpt());
  ASSERT_NE(trainer.tokenizer(), nullptr);
  EXPECT_EQ(trainer.tokenizer()->describe(), "characters (25)");
  EXPECT_NE(trainer.summary().find("vocab 25, "), std::string::npos) << trainer.summary();
  EXPECT_NE(trainer.summary().find(" (" + std::to_string(small_corpus().size()) + " chars)"), std::string::npos)
      << trainer.summary();
  EXPECT_EQ(files(), (std::set<std::string>{"corpus.txt"}));
}

TEST_F(TokenizerTest, SentencePieceRoundTripsAndLoadsTheSameIds) {
  const std::string model = path("bpe.model");
  const auto tok = rm::Tokenizer::train_sentencepiece(corpus_, kVocab, model);
  EXPECT_EQ(tok.vocab_size(), kVocab);
  EXPECT_FALSE(tok.is_characters());
  EXPECT_EQ(tok.describe(), "sentencepiece bpe 320 (" + model + ")");
  const std::string text = small_corpus();
  const auto ids = tok.encode(text);
  for (int64_t id : ids) ASSERT_TRUE(id >= 0 && id < kVocab) << id;
  EXPECT_LT(ids.size(), text.size() * 3 / 5) << "subwords: fewer tokens than bytes (0.55 here)";
  EXPECT_EQ(tok.decode(ids), text);
  // Characters the corpus lacks (and indentation, tabs, UTF-8) fall back to bytes.
  const std::string unseen = "  Zurich\tand Z\xc3\xbcrich.\n\n    the block\n";
  EXPECT_EQ(tok.decode(tok.encode(unseen)), unseen);

  const auto loaded = rm::Tokenizer::load(model);
  EXPECT_EQ(loaded.encode(text), ids);
  EXPECT_EQ(loaded.encode(unseen), tok.encode(unseen));
  EXPECT_EQ(loaded.describe(), tok.describe());
  EXPECT_EQ(loaded.fingerprint(), tok.fingerprint());
  // Training again gives the same model; in memory it writes nothing.
  const auto again = rm::Tokenizer::train_sentencepiece(corpus_, kVocab, "");
  EXPECT_EQ(again.describe(), "sentencepiece bpe 320 (in memory)");
  EXPECT_EQ(again.fingerprint(), tok.fingerprint());
  EXPECT_EQ(files(), (std::set<std::string>{"corpus.txt", "bpe.model"}));
}

TEST_F(TokenizerTest, TrainerTrainsWithASentencePieceVocabulary) {
  auto cfg = tiny_gpt();
  cfg.vocab_size = kVocab;
  cfg.tokenizer = path("gpt.model");
  cfg.save_path = path("run.pt");
  {
    rm::Trainer trainer(cfg);
    ASSERT_NE(trainer.tokenizer(), nullptr);
    EXPECT_EQ(trainer.tokenizer()->vocab_size(), kVocab);
    EXPECT_EQ(rm::Tokenizer::load(cfg.tokenizer).vocab_size(), kVocab);
    auto* gpt = dynamic_cast<rm::GptImpl*>(trainer.module().get());
    ASSERT_NE(gpt, nullptr);
    EXPECT_EQ(gpt->head_weight().size(0), kVocab);
    const std::string summary = trainer.summary();
    EXPECT_NE(summary.find("vocab 320, "), std::string::npos) << summary;
    EXPECT_NE(summary.find(" tokens); tokenizer sentencepiece bpe 320 (" + cfg.tokenizer + ")"), std::string::npos)
        << summary;
    const auto steps = trainer.run();
    ASSERT_EQ(steps.size(), 2u);
    for (const auto& s : steps) EXPECT_TRUE(std::isfinite(s.loss)) << s.loss;
  }
  // Resume with the model file (no training): continues; with the character
  // level: refused, naming both vocabularies.
  auto resumed = tiny_gpt();
  resumed.tokenizer = cfg.tokenizer;
  resumed.resume_path = cfg.save_path;
  resumed.steps = 3;
  {
    rm::Trainer trainer(resumed);
    EXPECT_EQ(trainer.steps_done(), 2);
    EXPECT_EQ(trainer.run().size(), 1u);
  }
  auto chars = tiny_gpt();
  chars.resume_path = cfg.save_path;
  const std::string fp = rm::Tokenizer::load(cfg.tokenizer).fingerprint();
  EXPECT_EQ(error_of([&] { rm::Trainer t(chars); }),
            "[remat::train] checkpoint '" + cfg.save_path +
                "' was trained with another vocabulary ('vocab=320 tokenizer=" + fp +
                "'); this run's is 'vocab=25', characters (25). Resume with the tokenizer it was trained with: the "
                "same --tokenizer PATH (none for the character level) and --data.");
  EXPECT_EQ(files(), (std::set<std::string>{"corpus.txt", "gpt.model", "run.pt"}));
}

TEST_F(TokenizerTest, MaxUnderCountsTokensAndLeavesNoModelBehind) {
  auto cfg = tiny_gpt();
  cfg.vocab_size = kVocab;  // no tokenizer path: max_under trains to a temporary file
  const auto tokens =
      static_cast<int64_t>(rm::Tokenizer::train_sentencepiece(corpus_, kVocab, "").encode(small_corpus()).size());
  rm::FitOptions fit;
  fit.cap_bytes = int64_t{1} << 30;  // the data, not the cap, stops the search
  fit.verify = false;
  const auto r = rm::max_under(cfg, fit);
  EXPECT_TRUE(r.at_max_value);
  EXPECT_EQ(r.value, tokens - 2) << "seq_len's limit is the text's tokens - 2, not its bytes";
  EXPECT_LT(r.value, static_cast<int64_t>(small_corpus().size()) - 2);
  EXPECT_FALSE(fs::exists(fs::temp_directory_path() / ("remat-tokenizer-" + std::to_string(::getpid()) + ".model")));
  EXPECT_EQ(files(), (std::set<std::string>{"corpus.txt"}));
}

// encode() reports its progress after each 64 KiB piece, up to the whole text.
TEST_F(TokenizerTest, EncodeReportsProgress) {
  const auto tok = rm::Tokenizer::train_sentencepiece(corpus_, kVocab, "");
  std::string text;
  while (text.size() < 300 * 1024) text += small_corpus();
  std::vector<int64_t> done;
  const auto ids = tok.encode(text, [&](int64_t bytes) { done.push_back(bytes); });
  EXPECT_EQ(ids, tok.encode(text));
  ASSERT_GE(done.size(), 4u) << "one report per 64 KiB piece";
  EXPECT_TRUE(std::is_sorted(done.begin(), done.end()));
  EXPECT_EQ(done.back(), static_cast<int64_t>(text.size()));
}

// The trainer keeps the corpus's ids in the token cache: the second run
// reads them (the same ids: the same losses); a changed corpus or tokenizer
// misses; a damaged file is encoded again; no temporary file is left; the
// long phases (training, encoding) are reported on the log.
TEST_F(TokenizerTest, TrainerCachesTheTokenIdsPerCorpusAndTokenizer) {
  const std::string cache = path("cache");
  auto cfg = tiny_gpt();
  cfg.vocab_size = kVocab;
  cfg.tokenizer = path("tok.model");
  cfg.token_cache_dir = cache;
  auto losses_of = [](rm::Trainer& t) {
    std::vector<double> out;
    for (const auto& s : t.run()) out.push_back(s.loss);
    return out;
  };
  std::ostringstream log1;
  rm::Trainer first(cfg, &log1);
  EXPECT_NE(log1.str().find("tokenizer: training SentencePiece BPE 320 on " + corpus_), std::string::npos)
      << log1.str();
  EXPECT_NE(log1.str().find("tokenizer: trained in "), std::string::npos) << log1.str();
  EXPECT_NE(log1.str().find("tokenizer: encoding " + corpus_), std::string::npos) << log1.str();
  EXPECT_NE(log1.str().find(" tokens in "), std::string::npos) << log1.str();
  EXPECT_NE(log1.str().find("; cached in " + cache + "/ids-"), std::string::npos) << log1.str();
  const auto plain = losses_of(first);
  auto cached_files = [&] {
    std::set<std::string> out;
    for (const auto& e : fs::directory_iterator(cache)) out.insert(e.path().filename().string());
    return out;
  };
  ASSERT_EQ(cached_files().size(), 1u);
  const fs::path file = fs::path(cache) / *cached_files().begin();

  cfg.vocab_size = 0;  // load the tokenizer trained above
  std::ostringstream log2;
  rm::Trainer second(cfg, &log2);
  EXPECT_NE(log2.str().find(" token ids of " + corpus_ + " read from the cache " + file.string() + " in "),
            std::string::npos)
      << log2.str();
  EXPECT_EQ(log2.str().find("tokenizer: encoding"), std::string::npos) << log2.str();
  EXPECT_EQ(losses_of(second), plain) << "the cached ids are the encoded ones";

  {  // A damaged file (cut short) is not read: encoded again, and rewritten whole.
    const auto size = fs::file_size(file);
    fs::resize_file(file, size - 3);
    std::ostringstream log;
    rm::Trainer t(cfg, &log);
    EXPECT_NE(log.str().find("tokenizer: encoding"), std::string::npos) << log.str();
    EXPECT_EQ(fs::file_size(file), size);
  }
  {  // Another corpus: another file.
    std::ofstream(corpus_, std::ios::app) << "the planner and the budget.\n";
    std::ostringstream log;
    rm::Trainer t(cfg, &log);
    EXPECT_NE(log.str().find("tokenizer: encoding"), std::string::npos) << log.str();
    EXPECT_EQ(cached_files().size(), 2u);
  }
  {  // Another tokenizer on the same corpus: another file.
    cfg.vocab_size = kVocab + 8;
    std::ostringstream log;
    rm::Trainer t(cfg, &log);
    EXPECT_NE(log.str().find("tokenizer: encoding"), std::string::npos) << log.str();
    EXPECT_EQ(cached_files().size(), 3u);
  }
  for (const auto& name : cached_files()) EXPECT_EQ(name.find(".tmp."), std::string::npos) << name;
  {  // A cache that cannot be written costs the encoding only.
    cfg.vocab_size = 0;
    cfg.token_cache_dir = corpus_ + "/not-a-dir";
    std::ostringstream log;
    rm::Trainer t(cfg, &log);
    EXPECT_NE(log.str().find("; not cached (" + cfg.token_cache_dir + ": "), std::string::npos) << log.str();
    EXPECT_NE(log.str().find("), the next run encodes again"), std::string::npos) << log.str();
  }
  fs::remove_all(cache);
  fs::remove(cfg.tokenizer);
}

TEST_F(TokenizerTest, ErrorsNameTheValueAndTheRemedy) {
  const std::string missing = path("missing.model");
  EXPECT_EQ(error_of([&] { rm::Tokenizer::load(missing); }),
            "[remat::tokenizer] SentencePiece model '" + missing +
                "' does not exist. Train one with Tokenizer::train_sentencepiece (remat-train --vocab-size N "
                "--tokenizer " +
                missing + ").");
  EXPECT_EQ(error_of([&] {
              rm::Tokenizer::load(corpus_);
            }).rfind("[remat::tokenizer] '" + corpus_ + "' is not a SentencePiece model (", 0),
            0u);
  auto cfg = tiny_gpt();
  cfg.tokenizer = missing;
  EXPECT_EQ(error_of([&] { rm::Trainer t(cfg); }),
            "[remat::train] --tokenizer file '" + missing +
                "' does not exist. Train one on --data with --vocab-size N "
                "--tokenizer " +
                missing + " (e.g. --vocab-size 8000), or drop --tokenizer for the character level.");

  // SentencePiece's own failures, wrapped.
  EXPECT_EQ(error_of([&] { rm::Tokenizer::train_sentencepiece(corpus_, 100000, path("big.model")); })
                .rfind("[remat::tokenizer] cannot train a SentencePiece model of vocab_size 100000 on '" + corpus_ +
                           "': the text has pieces for at most ",
                       0),
            0u);
  const std::string too_big = error_of([&] { rm::Tokenizer::train_sentencepiece(corpus_, 100000, ""); });
  EXPECT_NE(too_big.find(". Use a vocab_size (--vocab-size) of at most "), std::string::npos) << too_big;
  EXPECT_NE(too_big.find(", or a longer text."), std::string::npos) << too_big;
  EXPECT_EQ(error_of([&] { rm::Tokenizer::train_sentencepiece(corpus_, 100, ""); }),
            "[remat::tokenizer] cannot train a SentencePiece model of vocab_size 100 on '" + corpus_ +
                "': its characters, special and byte pieces need 281. Use a vocab_size (--vocab-size) of at least "
                "281.");

  // vocab_size < 0 (and 0 for the Tokenizer, which has nothing to train then).
  EXPECT_EQ(error_of([&] { rm::Tokenizer::train_sentencepiece(corpus_, -1, ""); }),
            "[remat::tokenizer] vocab_size must be positive to train a SentencePiece model, got -1. Pass e.g. 8000 "
            "(--vocab-size 8000).");
  cfg = tiny_gpt();
  cfg.vocab_size = -5;
  EXPECT_EQ(error_of([&] { rm::Trainer t(cfg); }),
            "[remat::train] --vocab-size must be >= 0 (0: no SentencePiece training), got -5. Pass e.g. --vocab-size "
            "8000, or 0 for the character level.");
  // Too few tokens for the context: counted in tokens.
  cfg = tiny_gpt();
  cfg.vocab_size = kVocab;
  cfg.seq_len = 5000;  // the corpus has ~6 KB, but fewer tokens
  const std::string short_data = error_of([&] { rm::Trainer t(cfg); });
  EXPECT_EQ(short_data.rfind("[remat::train] --data file '" + corpus_ + "' has ", 0), 0u) << short_data;
  EXPECT_NE(short_data.find(" tokens (sentencepiece bpe 320 (in memory)), fewer than seq_len + 2 = 5002. Use a "
                            "longer text or a smaller --seq-len."),
            std::string::npos)
      << short_data;
  EXPECT_EQ(files(), (std::set<std::string>{"corpus.txt"}));
}
