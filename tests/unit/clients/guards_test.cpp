// The output guards: each kind of broken output is caught, ordinary answers are not.
#include <gtest/gtest.h>

#include <string>

#include "clients/display.h"
#include "clients/guards.h"
#include "clients/smoke.h"

namespace kiln::clients {
namespace {

using namespace std::string_literals;

std::string times(const std::string& s, int n) {
  std::string out;
  for (int i = 0; i < n; ++i) out += s;
  return out;
}

// Ordinary prose written for this test: ~150 words, no loops.
const std::string kProse =
    "The harbour town woke slowly that morning. Fishermen checked their nets while gulls argued over "
    "scraps on the pier, and the baker opened his shutters to let the smell of fresh bread drift down "
    "the hill. Anna, who kept the lighthouse, climbed the spiral stairs one last time before handing the "
    "keys to her nephew. She had tended the lamp for thirty-one winters, logging every ship that passed "
    "and every storm that rattled the glass. Her notebooks filled a whole shelf in the kitchen. Tomas "
    "listened carefully as she explained the clockwork, the brass fittings that needed oil each week, and "
    "the quiet signals that meant a vessel was in trouble. When the tide turned, they walked together "
    "along the breakwater, watching the ferry leave for the mainland. Neither of them spoke much; there "
    "was little left to say that the sea had not already said for them.";

TEST(BadCharacters, CatchesNulReplacementControlAndInvalidUtf8) {
  EXPECT_FALSE(check_bad_characters("plain text\twith tab\nand newline\r\n"));
  EXPECT_FALSE(check_bad_characters("日本語 and émoji 🙂"));
  auto nul = check_bad_characters("ab\0\0c"s);
  ASSERT_TRUE(nul);
  EXPECT_NE(nul->find("2 NUL"), std::string::npos) << *nul;
  EXPECT_NE(nul->find("byte 2"), std::string::npos) << *nul;
  auto fffd = check_bad_characters("bad \xEF\xBF\xBD byte");
  ASSERT_TRUE(fffd);
  EXPECT_NE(fffd->find("U+FFFD"), std::string::npos);
  auto control = check_bad_characters("bell\x07");
  ASSERT_TRUE(control);
  EXPECT_NE(control->find("U+0007"), std::string::npos) << *control;
  EXPECT_TRUE(check_bad_characters("cut \xC3"));        // truncated sequence
  EXPECT_TRUE(check_bad_characters("overlong \xC0\xAF"));  // overlong '/'
  EXPECT_TRUE(check_bad_characters("surrogate \xED\xA0\x80"));
  EXPECT_TRUE(check_bad_characters("stray \x80 continuation"));
}

TEST(NoLettersOrDigits, CatchesPunctuationGarbage) {
  auto why = check_no_letters_or_digits("!!!!!!");
  ASSERT_TRUE(why);
  EXPECT_NE(why->find("garbage"), std::string::npos);
  EXPECT_TRUE(check_no_letters_or_digits("?? ... !!"));
  EXPECT_FALSE(check_no_letters_or_digits("OK"));
  EXPECT_FALSE(check_no_letters_or_digits("323"));
  EXPECT_FALSE(check_no_letters_or_digits("   "));        // emptiness is check_output's business
  EXPECT_FALSE(check_no_letters_or_digits("答案是三百二十三"));  // non-Latin letters
}

TEST(Repetition, RunsOfOneCharacter) {
  auto why = check_repetition(times("!", 40));
  ASSERT_TRUE(why);
  EXPECT_NE(why->find("\"!\" repeated 40 times"), std::string::npos) << *why;
  EXPECT_FALSE(check_repetition(times("!", 39)));  // shorter than min_run_chars
  EXPECT_TRUE(check_repetition("Answer: " + times("0", 64) + " done"));
}

TEST(Repetition, RunsOfWordsAndPhrases) {
  auto why = check_repetition("I think " + times("the ", 12) + "end");
  ASSERT_TRUE(why);
  EXPECT_NE(why->find("the\" repeated 12 times"), std::string::npos) << *why;  // phase: " the"
  EXPECT_FALSE(check_repetition(times("ab", 19)));  // 38 characters
  EXPECT_TRUE(check_repetition(times("ab", 20)));   // 40 characters
  // A sentence looping 4 times is degenerate, 3 times is not (yet).
  const std::string sentence = "The keeper climbed the stairs to light the lamp. ";
  EXPECT_TRUE(check_repetition(kProse + " " + times(sentence, 4)));
  EXPECT_FALSE(check_repetition("Intro. " + times(sentence, 3)));
  // Multi-byte text loops too.
  EXPECT_TRUE(check_repetition(times("日本", 20)));
}

TEST(Repetition, WhitespaceRunsAreNotDegenerate) {
  EXPECT_FALSE(check_repetition("a" + times(" ", 100) + "b"));
  EXPECT_FALSE(check_repetition("code:\n" + times("\n", 60) + "end"));
}

TEST(Repetition, OneWordDominatingALongText) {
  // "zero" is every other word: no exact run (the other words differ) but 50% of the words.
  std::string text;
  const char* others[] = {"alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"};
  for (int i = 0; i < 30; ++i) text += std::string("zero ") + others[i % 10] + std::to_string(i) + " ";
  auto why = check_repetition(text);
  ASSERT_TRUE(why);
  EXPECT_NE(why->find("\"zero\" makes up 50%"), std::string::npos) << *why;
}

TEST(Repetition, PhrasesComingBackWithVariations) {
  // The same 12 words six times, with different punctuation and case each time: no exact character
  // run, no dominant word (each ~8%), but only a few distinct 3-grams.
  const char* seps[] = {". ", "! ", "; ", ", ", "? ", " - "};
  std::string text;
  for (int i = 0; i < 6; ++i) {
    std::string s = "the old keeper walked down to the harbour every single quiet morning";
    if (i % 2) s[0] = 'T';
    if (i % 3 == 2) s[4] = 'O';
    text += s + seps[i];
  }
  auto why = check_repetition(text);
  ASSERT_TRUE(why);
  EXPECT_NE(why->find("3-grams are distinct"), std::string::npos) << *why;
}

TEST(Repetition, NaturalTextPasses) {
  EXPECT_FALSE(check_repetition(kProse));
  EXPECT_FALSE(check_repetition("OK"));
  EXPECT_FALSE(check_repetition("17 x 19 = 323"));
  EXPECT_FALSE(check_repetition("| a | b |\n|---|---|\n| 1 | 2 |"));
  EXPECT_FALSE(check_repetition("Wait... let me check: 17 x 19 = 17 x 20 - 17 = 340 - 17 = 323. Yes, 323."));
}

TEST(ThinkTags, AnyTagIsALeak) {
  EXPECT_TRUE(check_think_tags("<think>\nreasoning\n</think>\n\n323"));
  EXPECT_TRUE(check_think_tags("reasoning</think>323"));
  EXPECT_FALSE(check_think_tags("I think it is 323"));
}

TEST(CheckOutput, CombinesTheGuardsAndNamesTheField) {
  auto empty = check_output("  \n", "content");
  ASSERT_TRUE(empty);
  EXPECT_EQ(*empty, "content is empty");
  EXPECT_FALSE(check_output("", "reasoning", /*allow_empty=*/true));
  auto nul = check_output("!!!!!!\0\0\0!!!!!!"s, "content");
  ASSERT_TRUE(nul);
  EXPECT_NE(nul->find("content: 3 NUL"), std::string::npos) << *nul;
  auto bangs = check_output("!!!!!!", "content");
  ASSERT_TRUE(bangs);
  EXPECT_NE(bangs->find("garbage"), std::string::npos);
  EXPECT_TRUE(check_output("<think>x</think>323", "content"));
  EXPECT_FALSE(check_output("OK", "content"));
  EXPECT_FALSE(check_output(kProse, "content"));
}

TEST(WholeNumber, FindsTheAnswerNotPartsOfOtherNumbers) {
  EXPECT_TRUE(contains_whole_number("323", "323"));
  EXPECT_TRUE(contains_whole_number("17 x 19 = 323.", "323"));
  EXPECT_TRUE(contains_whole_number("**323**", "323"));
  EXPECT_TRUE(contains_whole_number("3230 no, 323 yes", "323"));
  EXPECT_FALSE(contains_whole_number("324", "323"));
  EXPECT_FALSE(contains_whole_number("3230", "323"));
  EXPECT_FALSE(contains_whole_number("1323", "323"));
  EXPECT_FALSE(contains_whole_number("323.5", "323"));
  EXPECT_FALSE(contains_whole_number("3,323", "323"));
  EXPECT_FALSE(contains_whole_number("323,000", "323"));
}

TEST(Display, QuotesEscapesAndCuts) {
  EXPECT_EQ(quote_for_display("OK"), "\"OK\"");
  EXPECT_EQ(quote_for_display("a\nb\"c\0"s), "\"a\\nb\\\"c\\u0000\"");
  EXPECT_EQ(quote_for_display("abcdef", 3), "\"abc\"...(6 bytes)");
  // A cut never splits a UTF-8 character.
  EXPECT_EQ(quote_for_display("日本語", 2), "\"日本\"...(9 bytes)");
  EXPECT_EQ(trim("  OK \n"), "OK");
  EXPECT_EQ(trim(" \n "), "");
}

}  // namespace
}  // namespace kiln::clients
