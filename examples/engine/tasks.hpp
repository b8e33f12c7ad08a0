// The long-range tasks the example model was trained on (train/tasks.py
// writes the same formats), drawn here from held-out filler for the
// evaluation. Every sample is whole lines of filler with a fact placed far
// before the end, and an answer span the evaluation scores:
//   passkey  "The pass key is 48213. Remember it. 48213 is the pass key.\n" at
//            a depth; the prompt ends "What is the pass key? The pass key is ",
//            the answer is "48213.\n"
//   recall   3-6 lines "Boaz's number is 4821.\n" in the first three quarters;
//            the prompt ends "What is Boaz's number? Boaz's number is ", the
//            answer is "4821.\n"
//   repeat   a 128-byte passage, 300-900 bytes of filler, the passage's first
//            32 bytes again: the answer is its other 96 bytes
#pragma once

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace engine {

struct TaskSample {
  std::vector<std::int32_t> prompt;  // ends where the answer starts
  std::vector<std::int32_t> answer;
};

class Tasks {
 public:
  explicit Tasks(std::vector<std::int32_t> text) : text_(std::move(text)) {
    starts_.push_back(0);
    for (std::size_t i = 0; i + 1 < text_.size(); ++i)
      if (text_[i] == '\n') starts_.push_back(i + 1);
  }

  // The key at `depth` (0..1: the fraction of the filler before it).
  TaskSample passkey(std::mt19937_64& rng, std::int32_t length, double depth) const {
    const std::int32_t digits = 5 + std::int32_t(rng() % 4);
    std::string key = std::to_string(1 + rng() % 9);
    for (std::int32_t i = 1; i < digits; ++i) key += char('0' + rng() % 10);
    const std::string needle = "The pass key is " + key + ". Remember it. " + key + " is the pass key.\n";
    const std::string question = "What is the pass key? The pass key is ", answer = key + ".\n";
    const std::int32_t room = length - std::int32_t(needle.size() + question.size() + answer.size());
    const auto before = filler(rng, std::int32_t(room * depth));
    TaskSample s;
    append(s.prompt, before);
    append(s.prompt, needle);
    append(s.prompt, filler(rng, room - std::int32_t(before.size())));
    append(s.prompt, question);
    append(s.answer, answer);
    return s;
  }

  TaskSample recall(std::mt19937_64& rng, std::int32_t length) const {
    static const char* const names[] = {"Aaron", "Abigail", "Boaz",  "Caleb",  "Deborah",  "Eli",   "Esther", "Gideon",
                                        "Hannah", "Isaac",  "Jael",  "Jonah",  "Leah",     "Micah", "Miriam", "Naomi",
                                        "Obed",  "Phinehas", "Rahab", "Ruth", "Samson", "Tamar", "Uriah",  "Zillah"};
    const std::int32_t pairs = 3 + std::int32_t(rng() % 4);
    std::vector<std::int32_t> pick(24);
    for (std::int32_t i = 0; i < 24; ++i) pick[std::size_t(i)] = i;
    std::shuffle(pick.begin(), pick.end(), rng);
    std::vector<std::string> lines, values;
    std::int32_t used = 0;
    for (std::int32_t i = 0; i < pairs; ++i) {
      values.push_back(std::to_string(1000 + rng() % 9000));
      lines.push_back(std::string(names[pick[std::size_t(i)]]) + "'s number is " + values.back() + ".\n");
      used += std::int32_t(lines.back().size());
    }
    const std::int32_t asked = std::int32_t(rng() % std::uint64_t(pairs));
    const std::string name = names[pick[std::size_t(asked)]];
    const std::string question = "What is " + name + "'s number? " + name + "'s number is ",
                      answer = values[std::size_t(asked)] + ".\n";
    const std::int32_t room = length - used - std::int32_t(question.size() + answer.size());
    std::vector<std::int32_t> cuts;
    for (std::int32_t i = 0; i < pairs; ++i) cuts.push_back(std::int32_t(rng() % std::uint64_t(room * 3 / 4 + 1)));
    std::sort(cuts.begin(), cuts.end());
    TaskSample s;
    std::int32_t at = 0;
    for (std::int32_t i = 0; i < pairs; ++i) {
      append(s.prompt, filler(rng, cuts[std::size_t(i)] - at));
      append(s.prompt, lines[std::size_t(i)]);
      at = cuts[std::size_t(i)];
    }
    append(s.prompt, filler(rng, room - at));
    append(s.prompt, question);
    append(s.answer, answer);
    return s;
  }

  TaskSample repeat(std::mt19937_64& rng, std::int32_t length, std::int32_t passage = 128,
                    std::int32_t prefix = 32) const {
    const auto p = filler(rng, passage);
    const std::int32_t gap = 300 + std::int32_t(rng() % std::uint64_t(std::min(900, length - 2 * passage) - 300 + 1));
    TaskSample s;
    append(s.prompt, filler(rng, length - 2 * passage - gap));
    s.prompt.insert(s.prompt.end(), p.begin(), p.end());
    append(s.prompt, filler(rng, gap));
    s.prompt.insert(s.prompt.end(), p.begin(), p.begin() + prefix);
    s.answer.assign(p.begin() + prefix, p.end());
    return s;
  }

  // Exactly n bytes of whole lines from random places (the last one cut).
  std::vector<std::int32_t> filler(std::mt19937_64& rng, std::int32_t n) const {
    std::vector<std::int32_t> out;
    while (std::int32_t(out.size()) < n) {
      const std::size_t s = starts_[rng() % starts_.size()];
      auto e = std::find(text_.begin() + std::ptrdiff_t(s), text_.end(), '\n');
      const auto len = std::int32_t(e - (text_.begin() + std::ptrdiff_t(s))) + 1;
      const std::int32_t take = std::min(len, n - std::int32_t(out.size()));
      out.insert(out.end(), text_.begin() + std::ptrdiff_t(s), text_.begin() + std::ptrdiff_t(s) + take - 1);
      out.push_back('\n');  // a cut line still ends with one
    }
    return out;
  }

 private:
  static void append(std::vector<std::int32_t>& out, const std::string& s) {
    for (const char c : s) out.push_back(static_cast<unsigned char>(c));
  }
  static void append(std::vector<std::int32_t>& out, const std::vector<std::int32_t>& s) {
    out.insert(out.end(), s.begin(), s.end());
  }
  std::vector<std::int32_t> text_;
  std::vector<std::size_t> starts_;
};

}  // namespace engine
